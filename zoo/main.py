"""Trains an experiment: `python -m zoo.main --config=experiments/x.py[:arg] --workdir=DIR`.

`--dry_run` prints the run's plan (zoo.run.plan) instead: nothing runs, and nothing is written
(except compiled programs to --compilation_cache_dir, if given).
"""
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags

from zoo import shell
from zoo.errors import ZooError
from zoo.parallel import topology
from zoo.run import compilation, plan, train
from zoo.run import config as cfg

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
_CACHE_DIR = flags.DEFINE_string(
    'compilation_cache_dir', None, 'Persistent XLA compilation cache: a restarted run loads its '
    'compiled steps from here instead of compiling them (e.g. a directory every host mounts).')
flags.mark_flags_as_required(['config'])


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise ZooError(f'unexpected arguments {argv[1:]}')
  if _CACHE_DIR.value:
    compilation.enable_cache(_CACHE_DIR.value)
  target = None
  if _TOPOLOGY.value or _MAX_BATCH.value:
    if not _DRY_RUN.value:
      raise ZooError('--topology and --max_batch go with --dry_run, which plans the run')
    if _TOPOLOGY.value:  # This host compiles for the target and runs nothing itself.
      target = topology.parse(_TOPOLOGY.value, _NUM_SLICES.value)
  shell.start_devices('cpu' if target else None)
  if _DRY_RUN.value:
    _dry_run(cfg.from_flag(_CONFIG), _DEVICE_MEMORY.value, target, _MAX_BATCH.value)
    return
  if _DEVICE_MEMORY.value:
    raise ZooError('--device_memory_gib goes with --dry_run, which checks the plan against it')
  if not _WORKDIR.value:
    raise ZooError('--workdir is required (or --dry_run, which writes nothing)')
  train.train_and_evaluate(cfg.from_flag(_CONFIG), _WORKDIR.value)
  if compilation.summary():
    logging.info('XLA compilation cache: %s', compilation.summary())


def _dry_run(config, device_memory_gib, target, max_batch):
  if not 0 <= device_memory_gib < float('inf'):  # (NaN fails too.)
    raise ZooError(f'--device_memory_gib: must be a finite number >= 0 (0: no check), got '
                   f'{device_memory_gib}')
  p = plan.make_plan(config, device_memory_gib, target)
  if jax.process_index() == 0:
    print(plan.format_plan(p), flush=True)
  if max_batch:
    found = plan.max_batch(config, device_memory_gib, target)
    if jax.process_index() == 0:
      print(plan.format_max_batch(found), flush=True)
  if p['fits'] is False:
    shell.fail(plan.refusal_line(p, device_memory_gib))


if __name__ == '__main__':
  shell.define_flags()
  shell.run(main)
