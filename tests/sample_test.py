"""`python -m zoo.sample`: the same text on any mesh, greedy = top-1, seeds, the key/value
cache against recomputing, every bad input."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, cli_env, count_calls, load_config
from zoo.errors import CheckpointError, ConfigError
from zoo.models import decode
from zoo.run import sampling
from zoo.run import train

PROMPT = 'The '
NUM_CHARS = 50  # Beyond the smoke model's max_len of 32: the context slides.


def run_sample(*args, devices=8):
  """Runs `python -m zoo.sample ARGS` on `devices` emulated CPU devices."""
  env = cli_env()
  cmd = [sys.executable, '-m', 'zoo.sample', f'--cpu_devices={devices}', *args]
  return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=120,
                        check=False)


@pytest.fixture(scope='module')
def lm_workdir(tmp_path_factory):
  """A smoke char_lm run of 2 steps: nearly random weights, so greedy text is varied (a
  trained smoke model's greedy text is all spaces, which would match on any mesh)."""
  workdir = str(tmp_path_factory.mktemp('char_lm'))
  config = load_config('char_lm', **{'train.steps': 2, 'eval.max_batches': 1,
                                     'checkpoint.async_save': False})
  train.train_and_evaluate(config, workdir)
  return workdir


def _greedy(workdir, **kwargs):
  return sampling.generate_text(workdir, PROMPT, NUM_CHARS, temperature=0.0, **kwargs)


@pytest.fixture(scope='module')
def greedy_text(lm_workdir):
  """lm_workdir's greedy text on the default mesh (8 devices on 'model'), computed once for
  the tests that compare with it."""
  return _greedy(lm_workdir)


def test_greedy_is_the_same_on_one_and_eight_devices(lm_workdir, greedy_text, devices):
  [text] = greedy_text  # Default mesh: 8 devices on 'model'.
  assert text.startswith(PROMPT) and len(text) == len(PROMPT) + NUM_CHARS
  assert len(set(text[len(PROMPT):])) > 5, f'greedy text too uniform to compare meshes: {text!r}'
  # 3 devices: 8 heads do not split 3 ways, so the default falls back to one device: the
  # mesh (1, 1) and rules that --cpu_devices=1 gives, so one run checks both.
  result = run_sample(f'--workdir={lm_workdir}', f'--prompt={PROMPT}',
                      f'--num_chars={NUM_CHARS}', '--temperature=0', devices=3)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout == text + '\n'
  assert 'sampling on one device' in result.stderr


@pytest.mark.parametrize('options', [{'temperature': 0.0},
                                     {'temperature': 0.8, 'top_k': 20, 'top_p': 0.9}],
                         ids=['greedy', 'top-k-top-p'])
def test_the_cache_gives_the_same_tokens_on_every_mesh(lm_workdir, options, monkeypatch,
                                                       devices):
  """A sample within max_len takes the key/value cache by default (prefill, then a token
  per step); on every mesh (rows over 'batch', heads and the cache over 'model') it picks
  exactly the tokens that recomputing every window picks on the default mesh (itself the
  same as one device's, above): greedy, and sampled with temperature, top-k and top-p."""
  del devices
  prompts, num_tokens = ['The ', 'x = '], 20  # 4 + 20 <= max_len 32.
  options = dict(num_samples=4, seed=7, **options)  # 8 rows: split over 'batch'.
  want = [s['ids'] for s in sampling.generate(lm_workdir, prompts, num_tokens, decoding='recompute',
                                            **options)]
  rows = len(set(map(tuple, want)))
  assert rows > 2 if options['temperature'] else rows == 2  # Samples differ; greedy: per prompt.
  cached = count_calls(monkeypatch, decode, 'generate_cached')
  for mesh_shape in ('8,1', '4,2', '2,4', '1,8'):
    got = sampling.generate(lm_workdir, prompts, num_tokens, mesh_shape=mesh_shape, **options)
    assert [s['ids'] for s in got] == want, mesh_shape
  assert len(cached) == 4  # Every mesh decoded from the cache.


def test_top_1_equals_greedy(lm_workdir, greedy_text, devices):
  assert (sampling.generate_text(lm_workdir, PROMPT, NUM_CHARS, temperature=1.0, top_k=1)
          == greedy_text)


def test_seed_gives_the_same_samples_on_any_mesh(lm_workdir, devices):
  def draw(seed, mesh_shape=''):
    return sampling.generate_text(lm_workdir, PROMPT, NUM_CHARS, temperature=0.8, num_samples=3,
                                seed=seed, mesh_shape=mesh_shape)
  texts = draw(seed=3)
  assert len(set(texts)) == 3 and all(t.startswith(PROMPT) for t in texts)
  assert draw(seed=3) == texts
  assert draw(seed=3, mesh_shape='8,1') == texts  # 3 samples on 8 'batch' devices: replicated.
  assert draw(seed=4) != texts


def test_empty_prompt_starts_from_a_newline(lm_workdir, devices):
  # 12 tokens from one token: the program of 'A' alone below, compiled once.
  [text] = sampling.generate_text(lm_workdir, '', 12, temperature=0.0)
  assert len(text) == 12  # The newline it starts from is not returned.


@pytest.mark.parametrize('kwargs, message', [
    ({'prompt': 'caf\u00e9 \u00e9\u2603'}, "--prompt: characters not in the model's vocabulary of "),
    ({'mesh_shape': '3,3'}, '--mesh_shape: '),
    ({'mesh_shape': 'a,b'}, '--mesh_shape: '),
    ({'top_k': 10_000}, '--top_k: must be in [0, '),
    ({'temperature': -1.0}, '--temperature: '),
    ({'num_chars': 0}, '--num_chars: must be positive'),
])
def test_bad_arguments_are_rejected(lm_workdir, devices, kwargs, message):
  with pytest.raises(ConfigError, match='^' + message.replace('[', r'\[')) as e:
    sampling.generate_text(lm_workdir, **kwargs)
  if 'prompt' in kwargs:
    assert str(e.value).endswith("'\u00e9', '\u2603'; leave them out")


def test_run_without_checkpoint_is_rejected(tmp_path, lm_workdir):
  os.symlink(os.path.join(lm_workdir, 'config.json'), tmp_path / 'config.json')
  with pytest.raises(CheckpointError, match='has no complete checkpoint yet'):
    sampling.generate_text(str(tmp_path))
  assert sorted(os.listdir(tmp_path)) == ['config.json']  # Nothing written.


def _assert_one_line_error(result, message):
  assert result.returncode != 0 and not result.stdout
  assert 'Traceback' not in result.stderr
  assert result.stderr.strip().splitlines()[-1].startswith('zoo: error: ' + message), result.stderr


def test_cli_rejects_a_missing_workdir(tmp_path):
  missing = tmp_path / 'nope'
  _assert_one_line_error(run_sample(f'--workdir={missing}'), f'--workdir: {missing} is not a directory')
  assert not missing.exists()


def test_cli_rejects_a_run_that_is_not_a_language_model(tmp_path):
  (tmp_path / 'config.json').write_text(load_config('mlp_digits').to_json_best_effort())
  _assert_one_line_error(run_sample(f'--workdir={tmp_path}'),
                         "--workdir: " + str(tmp_path) + " trained model 'mlp', not a language model")
  assert sorted(os.listdir(tmp_path)) == ['config.json']


@pytest.mark.parametrize('edit,message', [
    ({'num_heads': 3}, r"config\.model\.num_heads: 3 does not divide model\.d_model=64"),
    ({'name': 'nope'}, r"config\.model\.name: unknown model 'nope'"),
    ({'positions': 'spiral'}, r"config\.model\.positions: unknown positions 'spiral'"),
])
def test_a_hand_edited_config_is_checked_as_training_checks_it(lm_workdir, tmp_path, edit,
                                                               message):
  """zoo.sample, export and zoo.evaluate place a run from its config.json: its model section
  is checked by the same validation as training's, one line naming the file and field."""
  workdir = tmp_path / 'edited'
  shutil.copytree(lm_workdir, workdir)
  config = json.loads((workdir / 'config.json').read_text())
  config['model'].update(edit)
  (workdir / 'config.json').write_text(json.dumps(config))
  with pytest.raises(ConfigError, match=rf'^--workdir: .*edited/config\.json: {message}'):
    sampling.generate_text(str(workdir))


def test_prompts_of_different_lengths_share_a_batch(lm_workdir, devices):
  """Left-padded in one batch, each prompt continues exactly as it does alone."""
  del devices
  prompts = ['A', 'The result of ', 'x = ']
  batch = sampling.generate(lm_workdir, prompts, 12, temperature=0.0)
  alone = [sampling.generate(lm_workdir, [p], 12, temperature=0.0)[0] for p in prompts]
  assert [s['ids'] for s in batch] == [s['ids'] for s in alone]
  assert [s['prompt'] for s in batch] == prompts
  with pytest.raises(ConfigError, match=r'--prompt: prompts of different lengths are decoded with '
                                        r'the key/value cache'):
    sampling.generate(lm_workdir, prompts, 40, temperature=0.0)  # Past max_len 32: no cache.


def test_top_p_keeps_the_likeliest_tokens_that_reach_p():
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from zoo.models import decode  # pylint: disable=import-outside-toplevel
  logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32))
  def draws(top_p):  # Keys 0..199 in one program, not 200 eager calls (a compile per op).
    choose = lambda i: decode.choose(logits, jax_key(i), 1.0, top_p=top_p)[0]
    return set(np.asarray(jax.jit(jax.vmap(choose))(jnp.arange(200))).tolist())
  assert draws(0.75) == {0, 1}  # 0.5 < 0.75 needs the second; 0.8 reaches it.
  assert draws(0.81) == {0, 1, 2}


def jax_key(i):
  import jax  # pylint: disable=import-outside-toplevel
  return jax.random.key(i)


def test_json_format_prints_one_object_per_sample(lm_workdir):
  result = run_sample(f'--workdir={lm_workdir}', '--prompt=The ', '--prompt=A', '--num_tokens=5',
                      '--num_samples=2', '--format=json', '--temperature=0')
  assert result.returncode == 0, result.stderr[-3000:]
  rows = [json.loads(line) for line in result.stdout.splitlines()]
  assert [r['prompt'] for r in rows] == ['The ', 'The ', 'A', 'A']
  assert all(set(r) == {'prompt', 'text', 'prompt_ids', 'ids'} and len(r['ids']) == 5 for r in rows)
  assert rows[0]['prompt_ids'] == rows[1]['prompt_ids'] and len(rows[0]['prompt_ids']) == 4
