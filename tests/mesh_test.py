"""Sharding changes the layout, not the math: the same losses on every mesh."""
import numpy as np
import pytest

from conftest import experiment, load_config, read_metrics, run_cli
from zoo import train

STEPS = 8
MESHES = [(8, 1), (4, 2), (2, 4), (1, 8)]


def _losses(workdir):
  return np.array([r['train/loss'] for r in read_metrics(workdir) if 'train/loss' in r])


@pytest.mark.parametrize('name', ['mlp_digits', 'cnn_digits', 'char_lm'])
def test_same_losses_on_every_mesh_and_one_device(name, tmp_path, devices):
  del devices
  overrides = {'train.steps': STEPS, 'train.log_every_steps': 1, 'eval.every_steps': STEPS}
  runs = {}
  for shape in MESHES:
    workdir = str(tmp_path / f'{shape[0]}x{shape[1]}')
    train.train_and_evaluate(load_config(name, **overrides, **{'mesh.shape': shape}), workdir)
    runs[shape] = _losses(workdir)
  one = run_cli(f'--config={experiment(name)}:smoke', f'--workdir={tmp_path / "one"}',
                *(f'--config.{k}={v}' for k, v in overrides.items()), '--config.mesh.shape=(1,1)',
                devices=1)
  assert one.returncode == 0, one.stderr[-3000:]
  runs['one device'] = _losses(str(tmp_path / 'one'))

  reference = runs[(4, 2)]
  assert len(reference) == STEPS and reference[-1] < reference[0]
  for mesh, losses in runs.items():
    np.testing.assert_allclose(losses, reference, rtol=2e-5, atol=2e-5, err_msg=f'mesh {mesh}')
