"""Sharding changes the layout, not the math: the same losses on every mesh."""
import jax
import numpy as np
import pytest

from conftest import Trainer, load_config, trainer

STEPS = 8
MESHES = [(8, 1), (2, 4), (1, 8)]  # Data parallel, mixed, tensor parallel.


def _one_device_losses(name):
  """The same config's losses on one device, a (1, 1) mesh: no sharding at all. (In this
  process, on its first device: the program compiled for one device is the one a
  one-device process runs; the command line on one device is checkpoint_test's
  test_eight_devices_to_one_and_back.)"""
  t = Trainer(load_config(name, **{'mesh.shape': (1, 1), 'train.steps': STEPS}),
              devices=jax.devices()[:1])
  assert t.mesh.size == 1
  return np.array(t.run(STEPS))


@pytest.mark.parametrize('name', ['mlp_digits', 'cnn_digits', 'char_lm'])
def test_same_losses_on_every_mesh(name, devices):
  del devices
  runs = {shape: np.array(trainer(name, **{'mesh.shape': shape, 'train.steps': STEPS}).run(STEPS))
          for shape in MESHES}
  if name == 'char_lm':  # And on one device: no mesh at all.
    runs['one device'] = _one_device_losses(name)

  reference = runs[(2, 4)]
  assert len(reference) == STEPS and reference[-1] < reference[0]
  for mesh, losses in runs.items():
    np.testing.assert_allclose(losses, reference, rtol=2e-5, atol=2e-5, err_msg=f'mesh {mesh}')
