"""Bad values in every config field of every experiment: each is accepted (and then its
train and eval steps trace and lower), refused by the flag parser (a wrong type), or
refused by the preflight (config.validate, then the checked Setup with its memory bound)
with a ConfigError that names the field; never another exception, never a hang. The cases
come from the configs themselves, so a new field is covered without editing this test.

A field's bad values are tried once per validator, not once per experiment that shares it:
base_config's fields (the run's own checks) on one experiment; a model family's fields on
the experiment of that family that sets the most of them away from the family's defaults
(the most of its code switched on: for transformer_lm, moe_lm's routed experts, rotary
positions, RMSNorm and SwiGLU); a data source's own fields likewise; any other field on its
experiment. A new experiment adds cases only for the fields that no other experiment
shares. Every field of every experiment has bad values tried somewhere, and can be set
from the command line (the last two tests).
"""
import atexit
import dataclasses
import functools
import json
import math
import os
import shutil
import signal
import tempfile

import ml_collections
import pytest

from config_test import _parse_flags
from conftest import REPO, experiment, load_config
from zoo import data, models
from zoo.models import transformer
from zoo.errors import ConfigError
from zoo.run import config as cfg
from zoo.run import setup as setup_lib

# The experiments whose config needs an argument (the workdir of the model they tune).
# The fine-tuning ones' fields are all shared with others (transformer_lm's, the tokens
# source's, the run's), which the last tests check; model.lora's bad values are also
# tests/lora_test.py's. dpo_lm and grpo_sort own the preference and prompts sources': they
# are tried with a stand-in workdir (a config.json: the preflight reads no checkpoint).
NEEDS_ARGUMENT = ('finetune_lm', 'finetune_chat', 'dpo_lm', 'grpo_sort')
STAND_IN = tempfile.mkdtemp(prefix='zoo-fuzz-workdir-')
atexit.register(shutil.rmtree, STAND_IN, True)
with open(os.path.join(STAND_IN, 'config.json'), 'w', encoding='utf-8') as _f:
  json.dump({'model': {'name': 'transformer_lm', 'num_layers': 1, 'd_model': 16, 'num_heads': 2,
                       'mlp_dim': 64, 'max_len': 32, 'vocab_size': 257, 'use_bias': True,
                       'tie_embeddings': True, 'num_kv_heads': None}}, _f)
ALL = tuple(sorted(f[:-3] for f in os.listdir(os.path.join(REPO, 'experiments'))
                   if f.endswith('.py')))
# The run's fields are tried on the first, the quickest to check; ties go to the earlier.
EXPERIMENTS = ('mlp_digits',) + tuple(n for n in ALL if n not in NEEDS_ARGUMENT + ('mlp_digits',)
                                      ) + ('dpo_lm', 'grpo_sort')
# Experiments whose data a test makes (their configs name files that zoo.prepare writes).
PREPARED = {'bpe_lm': 'tokens', 'sort_lm': 'tokens', 'dpo_lm': 'preference',
            'grpo_sort': 'prompts'}
SECONDS = 30  # A case's preflight bound: a value that makes it hang fails the test.


def _leaves(node, prefix=''):
  """(dotted name, value, declared type) of every field: a None field's type is its
  placeholder's (NoneType for a plain None, which no command line can set)."""
  for key, value in node.items():
    name = f'{prefix}{key}'
    if isinstance(value, ml_collections.ConfigDict):
      yield from _leaves(value, name + '.')
    elif value is not None:
      yield name, value, type(value)
    else:
      try:
        yield name, value, node.get_ref(key).get_type()
      except ValueError:
        yield name, value, type(None)


RUN_FIELDS = {name for name, _, _ in _leaves(cfg.base_config())} - {'model.name', 'data.name'}


# The fields every Transformer family declares once, on transformer.Transformer, and checks
# with transformer.check_config: one validator, tried on one experiment.
_SHARED_TRANSFORMER_FIELDS = {f.name for f in dataclasses.fields(transformer.Transformer)}


def _owner(config, field: str) -> str:
  """Whose check a field's value meets: the run's (base_config's fields), the model
  family's, the data source's, or the experiment's own."""
  if field in RUN_FIELDS:
    return 'run'
  group = field.split('.')[0]
  if group == 'model' and field.split('.')[1] in _SHARED_TRANSFORMER_FIELDS and issubclass(
      models.MODELS[config.model.name].module, transformer.Transformer):
    return 'model Transformer'  # transformer.check_config's, for every Transformer family.
  if group in ('model', 'data'):
    return f'{group} {config[group].name}'
  return f'experiment {field}'


def _away(config, owner: str) -> int:
  """How many of the owner's fields `config` sets away from their defaults."""
  group = owner.split()[0]
  if group not in ('model', 'data'):
    return 0
  defaults = (cfg.model_config(config.model.name) if group == 'model' else
              cfg.base_config().data)
  default = {name: value for name, value, _ in _leaves(defaults)}
  return sum(name not in default or default[name] != value
             for name, value, _ in _leaves(config[group]))


def _bad_values(value, kind=None):
  """What a user might type by mistake, for a field holding `value` of type `kind`."""
  kind = kind or type(value)
  if kind is bool:
    return {'wrong type': 'abc'}
  if kind is int:
    return {'zero': 0, 'negative': -1, 'huge': 10**9, 'wrong type': 'abc'}
  if kind is float:
    return {'zero': 0.0, 'negative': -1.0, 'nan': math.nan, 'inf': math.inf, 'huge': 1e9,
            'wrong type': 'abc'}
  if kind is str:
    return {'unknown string': 'no-such-value', 'wrong type': 7}
  if kind is tuple and value and all(isinstance(v, int) for v in value):
    return {'zeros': (0,) * len(value), 'negative': (-2,) * len(value),
            'huge': (10**9,) * len(value), 'wrong length': (1,) * (len(value) + 1)}
  if kind is tuple and not value:  # Layer numbers, task names, a step range.
    return {'unknown string': ('no-such-value',), 'negative': (-1,)}
  if kind is tuple:  # Names (mesh axes, LoRA targets) or (logical axis, mesh axis) rules.
    return {'unknown string': value[:-1] + ('no-such-value',), 'empty': ()}
  return {}


@functools.lru_cache(maxsize=None)
def _config(name):
  return load_config(name, f'{STAND_IN},smoke' if name in NEEDS_ARGUMENT else 'smoke')


def _representatives() -> dict:
  """{owner: the experiment its fields are tried on}."""
  chosen = {}
  for name in EXPERIMENTS:
    config = _config(name)
    for owner in {_owner(config, field) for field, _, _ in _leaves(config)}:
      best = chosen.get(owner)
      if best is None or _away(config, owner) > _away(_config(best), owner):
        chosen[owner] = name
  chosen['run'] = EXPERIMENTS[0]
  return chosen


def _cases():
  representatives = _representatives()
  for name in EXPERIMENTS:
    config = _config(name)
    for field, value, kind in _leaves(config):
      if representatives[_owner(config, field)] != name:
        continue  # Tried on the experiment that represents its validator.
      for label, bad in _bad_values(value, kind).items():
        yield pytest.param(name, field, bad, id=f'{name}-{field}-{label}')


CASES = list(_cases())


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
def tokens_data(tmp_path_factory):
  """A small token dataset (bytes) for the experiments whose config names one."""
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


@pytest.fixture(scope='module')
def preference_data(tmp_path_factory):
  """A few preference pairs (bytes), prepared as `zoo.prepare preference` writes them."""
  from zoo.data import preference  # pylint: disable=import-outside-toplevel
  from zoo.data import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
  root = tmp_path_factory.mktemp('fuzz_pairs')
  tokenizer_lib.bytes_tokenizer().save(str(root / 'tokenizer.json'))
  (root / 'pairs.jsonl').write_text(''.join(json.dumps(
      {'prompt': f'{i} +', 'chosen': f' {i + 1}', 'rejected': f' {i + 2}'}) + '\n'
      for i in range(40)))
  (root / 'data').mkdir()
  preference.prepare([str(root / 'pairs.jsonl')], str(root / 'data'), str(root / 'tokenizer.json'),
                     val_fraction=0.2, seed=0)
  return str(root / 'data')


@pytest.fixture(scope='module')
def prompts_data(tmp_path_factory):
  """A few sorting prompts (bytes), prepared as `zoo.prepare prompts` writes them."""
  from zoo.data import prompts, sorting  # pylint: disable=import-outside-toplevel
  from zoo.data import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
  root = tmp_path_factory.mktemp('fuzz_prompts')
  tokenizer_lib.bytes_tokenizer().save(str(root / 'tokenizer.json'))
  sorting.write(str(root / 'sort'), sft=1, pairs=1, prompts=40)
  (root / 'data').mkdir()
  prompts.prepare([str(root / 'sort' / 'prompts.jsonl')], str(root / 'data'),
                  str(root / 'tokenizer.json'), val_fraction=0.2, seed=0)
  return str(root / 'data')


_LOWERED = set()  # (experiment, config) pairs whose steps this process traced and lowered.


@pytest.mark.parametrize('experiment,field,value', CASES)
def test_a_bad_value_is_accepted_or_refused_naming_its_field(experiment, field, value, devices,
                                                            request):
  config = load_config(experiment, f'{STAND_IN},smoke' if experiment in NEEDS_ARGUMENT else 'smoke')
  if experiment in PREPARED:
    config.data.path = request.getfixturevalue(f'{PREPARED[experiment]}_data')
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
    key = (experiment, config.to_json_best_effort(sort_keys=True))
    if key not in _LOWERED:  # A value equal to the default (zero, say) is the same config.
      with setup.scope():  # Accepted: the steps trace and lower (what a shape bug would stop).
        setup.jit_train_step().lower(setup.abstract_state(), setup.batch)
        setup.jit_eval_step().lower(setup.abstract_state(), setup.eval_batch())
      _LOWERED.add(key)
  except ConfigError as e:
    message = str(e)
    assert '\n' not in message, message
    assert field in message or f'.{leaf}' in message or f'{leaf}=' in message, (field, message)
  except _Hang:
    pytest.fail(f'{field}={value!r}: the preflight ran {SECONDS} s without a verdict')
  finally:
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope='module')
def every_config(tmp_path_factory):
  """{experiment: (its --config argument, its config)} for every experiment file, those
  that need an imported workdir given one (its config.json: a GPT-2-like import)."""
  imported = tmp_path_factory.mktemp('imported')
  (imported / 'config.json').write_text(json.dumps({'model': {
      'name': 'transformer_lm', 'num_layers': 1, 'd_model': 16, 'num_heads': 2, 'mlp_dim': 64,
      'max_len': 32, 'vocab_size': 257, 'use_bias': True, 'tie_embeddings': True,
      'num_kv_heads': None}}))
  args = {name: f'{imported},smoke' if name in NEEDS_ARGUMENT else 'smoke' for name in ALL}
  return {name: (arg, load_config(name, arg)) for name, arg in args.items()}


def test_every_field_of_every_experiment_has_bad_values_tried(every_config):
  """Each field of each experiment (the imported models' too) has bad values of its type,
  tried on the experiment that represents its validator; a field no case reaches (as
  moe_lm's model.vocab_size=None once was) fails here."""
  tried = {(_owner(_config(name), field), field) for name, field, _ in
           (case.values for case in CASES)}
  assert len(tried) > 100
  missing = [f'{name}: {field}={value!r}' for name, (_, config) in every_config.items()
             for field, value, kind in _leaves(config)
             if not _bad_values(value, kind) or (_owner(config, field), field) not in tried]
  assert not missing, missing


def _flag_value(value, kind):
  """A command-line value of `kind` other than `value` where there is one."""
  if kind is bool:
    return str(not value), not value
  if kind in (int, float):
    new = kind(7) if value is None else value + kind(1)
    return repr(new), new
  if kind is str:
    return value + 'x', value + 'x'
  return repr(value), value


@pytest.mark.parametrize('name', ALL)
def test_every_field_of_every_experiment_is_settable_from_the_command_line(name, every_config):
  """`--config.X=V` reaches the config for every field X of the experiment, the fields
  whose default is None included (a plain None is refused by the flag parser: 'Type
  NoneType ... is not supported for overriding')."""
  arg, config = every_config[name]
  fields = [(field, *_flag_value(value, kind)) for field, value, kind in _leaves(config)]
  parsed = _parse_flags([f'--config={experiment(name)}:{arg}'] +
                        [f'--config.{field}={text}' for field, text, _ in fields])
  for field, _, want in fields:
    node = parsed
    for key in field.split('.'):
      node = node[key]
    assert node == want, (field, node, want)
