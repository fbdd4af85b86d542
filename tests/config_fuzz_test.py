"""Bad values in every config field of every experiment: each is accepted (and then its
train and eval steps trace and lower), refused by the flag parser (a wrong type), or
refused by the preflight (config.validate, then the checked Setup with its memory bound)
with a ConfigError that names the field; never another exception, never a hang. The cases
come from the configs themselves, so a new field is covered without editing this test.

Fields shared by every experiment (base_config's) are tried on one experiment; the model
and data fields of each experiment on that experiment (finetune_lm's and finetune_chat's are
an imported model's: the same transformer_lm fields as char_lm's).
"""
import functools
import json
import math
import os
import signal

import ml_collections
import pytest

from conftest import REPO, load_config
from zoo import data
from zoo.errors import ConfigError
from zoo.run import config as cfg
from zoo.run import setup as setup_lib

# Every experiment file but those whose config needs an argument (finetune_lm and
# finetune_chat: an imported model's workdir; their model fields are transformer_lm's, as
# char_lm's and bpe_lm's, and model.lora's are fuzzed by tests/lora_test.py's bad values).
NEEDS_ARGUMENT = ('finetune_lm', 'finetune_chat')
# The shared fields are tried on the first, the quickest to check.
EXPERIMENTS = ('mlp_digits',) + tuple(sorted(
    f[:-3] for f in os.listdir(os.path.join(REPO, 'experiments'))
    if f.endswith('.py') and f[:-3] not in NEEDS_ARGUMENT + ('mlp_digits',)))
SECONDS = 30  # A case's preflight bound: a value that makes it hang fails the test.


def _leaves(node, prefix=''):
  for key, value in node.items():
    name = f'{prefix}{key}'
    if isinstance(value, ml_collections.ConfigDict):
      yield from _leaves(value, name + '.')
    else:
      yield name, value


def _bad_values(value):
  """What a user might type by mistake, for a field holding `value`."""
  if isinstance(value, bool):
    return {'wrong type': 'abc'}
  if isinstance(value, int):
    return {'zero': 0, 'negative': -1, 'huge': 10**9, 'wrong type': 'abc'}
  if isinstance(value, float):
    return {'zero': 0.0, 'negative': -1.0, 'nan': math.nan, 'inf': math.inf, 'huge': 1e9,
            'wrong type': 'abc'}
  if isinstance(value, str):
    return {'unknown string': 'no-such-value', 'wrong type': 7}
  if isinstance(value, tuple) and value and all(isinstance(v, int) for v in value):
    return {'zeros': (0,) * len(value), 'negative': (-2,) * len(value),
            'huge': (10**9,) * len(value), 'wrong length': (1,) * (len(value) + 1)}
  return {}


def _cases():
  shared = {name for name, _ in _leaves(cfg.base_config())} - {'model.name', 'data.name'}
  for i, name in enumerate(EXPERIMENTS):
    for field, value in _leaves(load_config(name)):
      if (field in shared) != (i == 0):
        continue  # Shared fields on the first experiment only.
      for label, bad in _bad_values(value).items():
        yield pytest.param(name, field, bad, id=f'{name}-{field}-{label}')


class _Hang(Exception):
  pass


def _alarm(signum, frame):
  raise _Hang()


@pytest.fixture(autouse=True)
def _cached_data(monkeypatch):
  """Datasets are functions of their config: loaded once per config for all cases."""
  original = data.load
  cached = functools.lru_cache(maxsize=None)(
      lambda key, seed: original(ml_collections.ConfigDict(dict(key)), seed))
  def load(data_config, seed):
    key = tuple(sorted((k, v if not isinstance(v, list) else tuple(v))
                       for k, v in data_config.to_dict().items()))
    return cached(key, seed)
  monkeypatch.setattr(data, 'load', load)


@pytest.fixture(scope='module')
def token_data(tmp_path_factory):
  """A small token dataset (bytes) for bpe_lm, whose config names one that zoo.prepare wrote."""
  from zoo.data import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
  from zoo.data import tokens  # pylint: disable=import-outside-toplevel
  root = tmp_path_factory.mktemp('fuzz_tokens')
  text = root / 'docs.jsonl'  # One document per line.
  text.write_text(''.join(json.dumps({'text': f'document {i}: the quick brown fox jumps over '
                                              f'{i % 17} lazy dogs. ' * 4}) + '\n'
                          for i in range(100)))
  (root / 'data').mkdir()
  tokens.prepare([str(text)], str(root / 'data'), tokenizer_lib.bytes_tokenizer(),
                 val_fraction=0.2)
  return str(root / 'data')


@pytest.mark.parametrize('experiment,field,value', list(_cases()))
def test_a_bad_value_is_accepted_or_refused_naming_its_field(experiment, field, value, devices,
                                                            token_data):
  config = load_config(experiment)
  if experiment == 'bpe_lm':
    config.data.path = token_data
  *groups, leaf = field.split('.')
  node = config
  for g in groups:
    node = node[g]
  try:
    node[leaf] = value
  except (TypeError, ValueError):
    return  # ml_collections keeps a field's type: the flag parser refuses it in one line.
  previous = signal.signal(signal.SIGALRM, _alarm)
  signal.alarm(SECONDS)
  try:
    cfg.validate(config, len(devices))
    setup = setup_lib.checked(config, devices)
    with setup.scope():  # Accepted: the steps trace and lower (what a shape bug would stop).
      setup.jit_train_step().lower(setup.abstract_state(), setup.batch)
      setup.jit_eval_step().lower(setup.abstract_state(), setup.eval_batch())
  except ConfigError as e:
    message = str(e)
    assert '\n' not in message, message
    assert field in message or f'.{leaf}' in message or f'{leaf}=' in message, (field, message)
  except _Hang:
    pytest.fail(f'{field}={value!r}: the preflight ran {SECONDS} s without a verdict')
  finally:
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)
