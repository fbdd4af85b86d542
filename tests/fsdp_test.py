"""The FSDP rules preset: same numbers, parameter and optimizer bytes per device ~ 1/N."""
import numpy as np

from conftest import load_config, trainer
from zoo.parallel import sharding


def test_fsdp_preset_splits_state_bytes_and_keeps_the_losses(devices):
  del devices
  # No warmup: steps 2 and 3 follow real updates (smoke's warmup starts at a rate of 0).
  tiny = {'mesh.shape': (8, 1), 'model.d_model': 64, 'data.seq_len': 16, 'model.max_len': 16,
          'train.batch_size': 8, 'optimizer.warmup_steps': 0}
  standard = trainer('char_lm', **tiny)
  fsdp = trainer('char_lm', **tiny, logical_axis_rules=sharding.fsdp_rules())
  np.testing.assert_allclose(fsdp.run(3), standard.run(3), rtol=2e-5)
  for part in ('params', 'opt_state'):
    before = sharding.per_device_bytes(getattr(standard.state, part))
    after = sharding.per_device_bytes(getattr(fsdp.state, part))
    # All but the few arrays without an 'embed' axis (biases of the MLP, the step count).
    assert after < before / 8 * 1.1, (part, before, after)


def test_fsdp_variant_of_the_experiment():
  config = load_config('char_lm', arg='smoke,fsdp')
  assert ('embed', 'batch') in [tuple(r) for r in config.logical_axis_rules]
  assert load_config('char_lm', arg='smoke').logical_axis_rules == sharding.standard_rules()
