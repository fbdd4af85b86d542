"""Trains an experiment: `python -m zoo.main --config=experiments/x.py[:arg] --workdir=DIR`.

`--dry_run` prints the run's plan (zoo.plan) instead: nothing runs, and nothing is written
(except compiled programs to --compilation_cache_dir, if given).
"""
import os
import sys

from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags

from zoo import compilation, distributed, metrics, plan, topology, train
from zoo.errors import ZooError

_CONFIG = config_flags.DEFINE_config_file(
    'config', None, 'Experiment file, e.g. experiments/char_lm.py:smoke.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory for checkpoints, metrics and logs.')
_DRY_RUN = flags.DEFINE_bool(
    'dry_run', False, 'Compile the train step for the mesh and print its plan: sharding, bytes '
    'and FLOPs per device, collectives. Runs nothing, writes no workdir (not needed).')
_DEVICE_MEMORY = flags.DEFINE_float(
    'device_memory_gib', 0.0, 'With --dry_run: memory per device; exit 1 if the step needs more.')
_TOPOLOGY = flags.DEFINE_string(
    'topology', None, 'With --dry_run: plan for a TPU pod slice, compiled here by the TPU '
    "compiler (needs .[tpu]): a Cloud TPU accelerator type (v5p-64, v5litepod-256, v6e-8, "
    "v4-32, tpu7x-8) or libtpu's GEN:AxBxC.")
_NUM_SLICES = flags.DEFINE_integer('num_slices', 1, 'With --topology: slices of it (multi-slice; '
                                   'set config.mesh.dcn_shape to match).')
_MAX_BATCH = flags.DEFINE_bool(
    'max_batch', False, 'With --dry_run: also search the largest train batch per device that '
    'the compiler fits (TPU targets; a binary search over compiles).')
_CPU_DEVICES = flags.DEFINE_integer(
    'cpu_devices', None, 'Run on this many emulated CPU devices (try a mesh without '
    'accelerators). Default on a host without accelerators: one per core (a power of two).')
_COORDINATOR = flags.DEFINE_string(
    'coordinator_address', None, 'host:port of process 0, for a multi-process job.')
_NUM_PROCESSES = flags.DEFINE_integer('num_processes', None, 'Processes in the job.')
_PROCESS_ID = flags.DEFINE_integer('process_id', None, 'This process, in [0, num_processes).')
_INIT_TIMEOUT = flags.DEFINE_integer(
    'initialization_timeout', 300, 'Seconds to wait for every process to join.')
_CACHE_DIR = flags.DEFINE_string(
    'compilation_cache_dir', None, 'Persistent XLA compilation cache: a restarted run loads its '
    'compiled steps from here instead of compiling them (e.g. a directory every host mounts).')
_HEARTBEAT_TIMEOUT = flags.DEFINE_integer(
    'heartbeat_timeout', 60,
    'Seconds of silence after which a process counts as dead and the others exit.')
_LOG_LIBRARIES = flags.DEFINE_bool(
    'log_libraries', False, "Also show installed libraries' INFO lines (orbax's per-save "
    'messages, ...); by default the console has zoo\'s lines and every warning.')
flags.mark_flags_as_required(['config'])


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    sys.exit(f'zoo: error: unexpected arguments {argv[1:]}')
  if not _LOG_LIBRARIES.value:
    metrics.quiet_libraries()
  try:
    if _CACHE_DIR.value:
      compilation.enable_cache(_CACHE_DIR.value)
    target = None
    if _TOPOLOGY.value or _MAX_BATCH.value:
      if not _DRY_RUN.value:
        raise ZooError('--topology and --max_batch go with --dry_run, which plans the run')
      if _TOPOLOGY.value:  # This host compiles for the target and runs nothing itself.
        target = topology.parse(_TOPOLOGY.value, _NUM_SLICES.value)
        jax.config.update('jax_platforms', 'cpu')
    per_core = distributed.initialize(
        _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value, _CPU_DEVICES.value,
        _INIT_TIMEOUT.value, _HEARTBEAT_TIMEOUT.value, per_core=True)
    if per_core and jax.default_backend() == 'cpu':
      logging.info('no accelerator: %d CPU devices, one per core (--cpu_devices=N to choose)',
                   jax.local_device_count())
    logging.info('JAX %s, process %d of %d, %d local / %d global devices: %s', jax.__version__,
                 jax.process_index(), jax.process_count(), jax.local_device_count(),
                 jax.device_count(), jax.devices())
    if _DRY_RUN.value:
      _dry_run(_CONFIG.value, _DEVICE_MEMORY.value, target, _MAX_BATCH.value)
      return
    if _DEVICE_MEMORY.value:
      raise ZooError('--device_memory_gib goes with --dry_run, which checks the plan against it')
    if not _WORKDIR.value:
      raise ZooError('--workdir is required (or --dry_run, which writes nothing)')
    train.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
    if compilation.summary():
      logging.info('XLA compilation cache: %s', compilation.summary())
  except ZooError as e:
    _exit(f'zoo: error: {e}')
  except Exception:  # pylint: disable=broad-except
    logging.exception('zoo: unexpected error')
    _exit('zoo: error: unexpected error, traceback above')


def _dry_run(config, device_memory_gib, target, max_batch):
  if device_memory_gib < 0:
    raise ZooError(f'--device_memory_gib: must be >= 0 (0: no check), got {device_memory_gib}')
  p = plan.make_plan(config, device_memory_gib, target)
  if jax.process_index() == 0:
    print(plan.format_plan(p), flush=True)
  if max_batch:
    found = plan.max_batch(config, device_memory_gib, target)
    if jax.process_index() == 0:
      print(plan.format_max_batch(found), flush=True)
  if p['fits'] is False:
    _exit(plan.refusal_line(p, device_memory_gib))


def _exit(message):
  """Exits 1. With peers, at once: a normal exit would wait for them at JAX's shutdown
  barrier, so a process failing alone would hang the job; its death instead ends every
  peer within --heartbeat_timeout."""
  if jax.process_count() > 1:
    sys.stderr.write(message + '\n')
    sys.stderr.flush()
    os._exit(1)  # pylint: disable=protected-access
  sys.exit(message)


if __name__ == '__main__':
  app.run(main)
