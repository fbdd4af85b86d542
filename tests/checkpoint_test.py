"""Checkpoints: resume equals a straight run, on any mesh, after any kill; strictness."""
import hashlib
import os
import re
import shutil

import jax
import numpy as np
import pytest

from conftest import experiment, load_config, read_metrics, run_cli, stop_at
from zoo import data
from zoo.errors import CheckpointError
from zoo.run import setup, train
from zoo.store import checkpoint

N = 6  # Steps before the stop; the runs go to 2N.


def _config(**overrides):
  return load_config('mlp_digits', **{
      'train.steps': 2 * N, 'train.log_every_steps': 1, 'eval.every_steps': 2 * N,
      'checkpoint.every_steps': N, 'mesh.shape': (4, 2), **overrides})


def _losses(workdir):
  return {r['step']: r['train/loss'] for r in read_metrics(workdir) if 'train/loss' in r}


def _restore(workdir, config, step=None):
  """The checkpointed tree of `workdir` restored onto `config`'s mesh, as numpy."""
  s = setup.build(config, data.load(config.data, config.seed))
  shardings = s.state_shardings
  with s.scope():
    target = checkpoint.saved_tree(s.abstract_state())
    manager = checkpoint.make_manager(workdir, 10, False)
    step = manager.latest_step() if step is None else step
    tree = manager.restore(step, args=checkpoint.restore_args(target))
    manager.close()
  for leaf, want in zip(jax.tree.leaves(tree), jax.tree.leaves(checkpoint.saved_tree(shardings))):
    assert leaf.sharding.is_equivalent_to(want, leaf.ndim)  # Restored into the current mesh.
  return jax.tree.map(np.asarray, tree)


def _assert_trees_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)


@pytest.fixture(scope='module')
def straight(tmp_path_factory):
  """A run of 2N steps that never stopped, checkpointed at N and 2N."""
  workdir = str(tmp_path_factory.mktemp('straight'))
  train.train_and_evaluate(_config(), workdir)
  return workdir


def test_stop_and_resume_is_bit_identical(straight, tmp_path, monkeypatch, devices):
  del devices
  workdir = str(tmp_path)
  stop_at(monkeypatch, N - 2)
  train.train_and_evaluate(_config(), workdir)
  assert sorted(_losses(workdir)) == list(range(1, N - 1))
  monkeypatch.undo()
  train.train_and_evaluate(_config(), workdir)
  assert _losses(workdir) == _losses(straight)  # Exact float equality, every step once.
  _assert_trees_equal(_restore(workdir, _config()), _restore(straight, _config()))


@pytest.mark.parametrize('shape', [(2, 4), (8, 1), (1, 8)])
def test_resume_on_another_mesh(straight, shape, tmp_path, devices):
  del devices
  workdir = str(tmp_path)
  shutil.copytree(os.path.join(straight, 'checkpoints', str(N)),
                  os.path.join(workdir, 'checkpoints', str(N)))
  # The saved state, restored onto the new mesh, equals it exactly.
  _assert_trees_equal(_restore(workdir, _config(**{'mesh.shape': shape})),
                      _restore(straight, _config(), step=N))
  train.train_and_evaluate(_config(**{'mesh.shape': shape}), workdir)
  resumed, reference = _losses(workdir), _losses(straight)
  assert sorted(resumed) == list(range(N + 1, 2 * N + 1))
  np.testing.assert_allclose([resumed[s] for s in sorted(resumed)],
                             [reference[s] for s in sorted(resumed)], rtol=2e-5)


def test_eight_devices_to_one_and_back(straight, tmp_path, caplog, devices):
  """Step N of the 8-device run, resumed on one device (a process of its own, through the
  command line), trains on as the 8-device run did; that device's own checkpoint, resumed
  on 8 devices (this process's), likewise (losses within float32 rounding of the other
  meshes, the final parameters too)."""
  del devices
  one = tmp_path / 'one'
  shutil.copytree(os.path.join(straight, 'checkpoints', str(N)), one / 'checkpoints' / str(N))
  every = N // 2  # The one-device run saves at 1.5 N (then 2 N).
  args = [f'--config={experiment("mlp_digits")}:smoke', f'--config.train.steps={2 * N}',
          '--config.train.log_every_steps=1', f'--config.checkpoint.every_steps={every}',
          f'--config.eval.every_steps={2 * N}', f'--workdir={one}']
  result = run_cli(*args, '--config.mesh.shape=(1,1)', devices=1)
  assert result.returncode == 0, result.stderr[-3000:]
  assert f'resuming from step {N}' in result.stderr
  reference, resumed = _losses(straight), _losses(str(one))
  assert sorted(resumed) == list(range(N + 1, 2 * N + 1))
  np.testing.assert_allclose([resumed[s] for s in sorted(resumed)],
                             [reference[s] for s in sorted(resumed)], rtol=2e-5)
  # ...and back onto 8 devices, from the checkpoint that one device wrote.
  os.rename(one / 'checkpoints' / str(2 * N), tmp_path / 'set_aside')
  with caplog.at_level('INFO'):
    train.train_and_evaluate(_config(**{'checkpoint.every_steps': every,
                                        'mesh.shape': (2, 4)}), str(one))
  assert f'resuming from step {N + every}' in caplog.text
  resumed = _losses(str(one))
  assert sorted(resumed) == list(range(N + 1, 2 * N + 1))
  np.testing.assert_allclose([resumed[s] for s in sorted(resumed)],
                             [reference[s] for s in sorted(resumed)], rtol=2e-5)
  final, want = _restore(str(one), _config()), _restore(straight, _config())
  for x, y in zip(jax.tree.leaves(final['params']), jax.tree.leaves(want['params'])):
    np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)


def _digest(directory):
  h = hashlib.sha256()
  for root, dirs, files in sorted(os.walk(directory)):
    dirs.sort()
    for name in sorted(files):
      path = os.path.join(root, name)
      h.update(path.encode())
      with open(path, 'rb') as f:
        h.update(f.read())
  return h.hexdigest()


def test_mismatched_model_lists_paths_and_touches_nothing(straight, tmp_path, devices):
  del devices
  workdir = tmp_path / 'run'
  shutil.copytree(straight, workdir)
  before = _digest(workdir)
  with pytest.raises(CheckpointError,
                     match=r'does not match .* params\.hidden_1\.kernel: checkpoint \(64, 64\) vs '
                           r'config \(64, 32\)'):
    train.train_and_evaluate(_config(**{'model.hidden_sizes': (64, 32)}), str(workdir))
  with pytest.raises(CheckpointError, match=r'params\.hidden_2\.kernel: missing'):
    train.train_and_evaluate(_config(**{'model.hidden_sizes': (64, 64, 64)}), str(workdir))
  assert _digest(workdir) == before


def _damage(step_dir, how):
  if how == 'metadata':
    with open(os.path.join(step_dir, 'default', '_METADATA'), 'w', encoding='utf-8'):
      return  # Emptied.
  files = sorted((os.path.getsize(os.path.join(r, f)), os.path.join(r, f))
                 for r, _, fs in os.walk(step_dir) for f in fs if os.sep + 'd' + os.sep in os.path.join(r, f))
  _, biggest = files[-1]
  if how == 'truncate':
    with open(biggest, 'r+b') as f:
      f.truncate(os.path.getsize(biggest) // 2)
  else:
    os.remove(biggest)


@pytest.mark.parametrize('how', ['truncate', 'delete', 'metadata'])
def test_damaged_checkpoint_fails_clearly_or_falls_back(straight, how, tmp_path, devices):
  del devices
  workdir = str(tmp_path)
  shutil.copytree(straight, workdir, dirs_exist_ok=True)
  _damage(os.path.join(workdir, 'checkpoints', str(2 * N)), how)
  config = _config()
  with pytest.raises(CheckpointError,
                     match=rf'checkpoint step {2 * N} .* is damaged .*checkpoint\.fallback=True '
                           rf'to resume from step {N}'):
    train.train_and_evaluate(config, workdir)
  config.checkpoint.fallback = True
  train.train_and_evaluate(config, workdir)
  assert os.path.isdir(os.path.join(workdir, 'checkpoints', f'{2 * N}.damaged'))
  losses, reference = _losses(workdir), _losses(straight)
  assert [losses[s] for s in range(N + 1, 2 * N + 1)] == [reference[s] for s in range(N + 1, 2 * N + 1)]


def test_a_first_save_cut_short_restarts_at_step_0_and_says_so(straight, tmp_path, caplog):
  """A kill during the first save leaves only `N.orbax-checkpoint-tmp`: never restored."""
  workdir = str(tmp_path)
  os.makedirs(os.path.join(workdir, 'checkpoints'))
  shutil.copytree(os.path.join(straight, 'checkpoints', str(N)),
                  os.path.join(workdir, 'checkpoints', f'{N}.orbax-checkpoint-tmp'))
  with caplog.at_level('INFO'):
    train.train_and_evaluate(_config(), workdir)
  assert 'no complete checkpoint in' in caplog.text and 'resuming' not in caplog.text
  assert _losses(workdir) == _losses(straight)
  assert sorted(os.listdir(os.path.join(workdir, 'checkpoints'))) == sorted([str(N), str(2 * N)])


def test_init_from_takes_params_only(straight, tmp_path, devices):
  del devices
  config = _config(**{'checkpoint.init_from': straight, 'train.steps': 2})
  state = train.train_and_evaluate(config, str(tmp_path))
  assert int(state.step) == 2  # A fresh run: its own step count and optimizer state.
  first = _losses(str(tmp_path))[1]
  assert first == pytest.approx(_losses(straight)[2 * N], abs=0.05)  # Starts where the source ended.
  with pytest.raises(CheckpointError, match=r'init_from: step \d+ .* does not match .* '
                                            r'params\.hidden_1\.kernel: checkpoint \(64, 64\) vs config \(64, 32\)'):
    train.train_and_evaluate(_config(**{'checkpoint.init_from': straight,
                                        'model.hidden_sizes': (64, 32)}), str(tmp_path / 'other'))
  assert not (tmp_path / 'other').exists()


def test_readme_snippet_loads_params_without_zoo(straight):
  with open(os.path.join(os.path.dirname(__file__), '..', 'docs', 'checkpoints.md'),
            encoding='utf-8') as f:
    readme = f.read()
  snippet = re.search(r'<!-- load-params -->\s*```python\n(.*?)```', readme, re.S).group(1)
  assert 'zoo' not in snippet.replace('workdir', '')
  scope = {'workdir': straight}
  exec(snippet, scope)  # pylint: disable=exec-used
  _assert_trees_equal(scope['params'], _restore(straight, _config())['params'])
