"""Sharding changes the layout, not the math: the same losses on every mesh."""
import numpy as np
import pytest

from conftest import experiment, read_metrics, run_cli, trainer

STEPS = 8
MESHES = [(8, 1), (2, 4), (1, 8)]  # Data parallel, mixed, tensor parallel.


@pytest.mark.parametrize('name', ['mlp_digits', 'cnn_digits', 'char_lm'])
def test_same_losses_on_every_mesh(name, tmp_path, devices):
  del devices
  runs = {shape: np.array(trainer(name, **{'mesh.shape': shape, 'train.steps': STEPS}).run(STEPS))
          for shape in MESHES}
  if name == 'char_lm':  # And on one real device, through the command line: no mesh at all.
    overrides = {'train.steps': STEPS, 'train.log_every_steps': 1, 'eval.every_steps': STEPS,
                 'mesh.shape': '(1,1)'}
    one = run_cli(f'--config={experiment(name)}:smoke', f'--workdir={tmp_path / "one"}',
                  *(f'--config.{k}={v}' for k, v in overrides.items()), devices=1)
    assert one.returncode == 0, one.stderr[-3000:]
    runs['one device'] = np.array([r['train/loss'] for r in read_metrics(str(tmp_path / 'one'))
                                   if 'train/loss' in r])

  reference = runs[(2, 4)]
  assert len(reference) == STEPS and reference[-1] < reference[0]
  for mesh, losses in runs.items():
    np.testing.assert_allclose(losses, reference, rtol=2e-5, atol=2e-5, err_msg=f'mesh {mesh}')
