"""Trains an experiment: `python -m zoo.main --config=experiments/x.py[:arg] --workdir=DIR`."""
import sys

from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags

from zoo import train
from zoo.errors import ZooError

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Experiment file, e.g. experiments/char_lm.py:smoke.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory for checkpoints, metrics and logs.')
_CPU_DEVICES = flags.DEFINE_integer(
    'cpu_devices', None, 'Run on this many emulated CPU devices (try a mesh without accelerators).')
flags.mark_flags_as_required(['config', 'workdir'])


def main(argv):
  if len(argv) > 1:
    sys.exit(f'zoo: error: unexpected arguments {argv[1:]}')
  if _CPU_DEVICES.value:  # Must act before JAX initialises its backends.
    jax.config.update('jax_platforms', 'cpu')
    jax.config.update('jax_num_cpu_devices', _CPU_DEVICES.value)
  logging.info('JAX %s, process %d of %d, %d local / %d global devices: %s', jax.__version__,
               jax.process_index(), jax.process_count(), jax.local_device_count(),
               jax.device_count(), jax.devices())
  try:
    train.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  except ZooError as e:
    sys.exit(f'zoo: error: {e}')


if __name__ == '__main__':
  app.run(main)
