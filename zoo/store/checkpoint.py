"""Orbax checkpoints of the sharded train state: save, resume on any mesh, warm-start.

The saved tree is `{'step', 'params', 'opt_state'}`, plus `model_state` for models with
BatchNorm statistics. Batches and per-step randomness are functions of (seed, step), so
the step is the whole data and RNG position. Every process
writes its own shards; restores read into abstract targets that carry the *current*
shardings, so a checkpoint written on one mesh restores onto any other.
"""
import asyncio
import contextlib
import os
import re
import signal
import threading
from typing import Any, Callable, Optional

from absl import logging
import flax.traverse_util
import jax
from jax.experimental import multihost_utils
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import type_handlers
from orbax.checkpoint.path import atomicity

from zoo.errors import CheckpointError, first_line
from zoo.store import storage


def _key_name(key):
  for attr in ('key', 'name', 'idx'):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def _shapes(tree):
  """{'params.block_0.attn.query': shape, ...}: orbax's names for the leaves of `tree`."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {'.'.join(_key_name(k) for k in path): tuple(leaf.shape) for path, leaf in flat}


def saved_tree(state: Any) -> dict:
  """The part of a TrainState that is checkpointed (the rest is code: apply_fn, tx).

  A model's mutable collections (BatchNorm statistics) are saved as `model_state`.
  """
  tree = {'step': state.step, 'params': state.params, 'opt_state': state.opt_state}
  if state.model_state:
    tree['model_state'] = state.model_state
  return tree


def save_args(tree: dict) -> ocp.args.PyTreeSave:
  return ocp.args.PyTreeSave(tree)


def restore_args(target: dict) -> ocp.args.PyTreeRestore:
  """Restore into `target`'s shapes, dtypes and shardings, whatever mesh saved it."""
  return ocp.args.PyTreeRestore(
      item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))


def _handler(replica_parallel=False, compress=True):
  """`compress=False` writes raw chunks: with zstd, tensorstore holds the compressed bytes of
  the whole save in host memory until it commits (measured: +1 GB for a 1 GB state of
  random floats, which barely compress), without, about one array. Reads take either."""
  registry = type_handlers.create_type_handler_registry(
      (jax.Array, type_handlers.ArrayHandler(use_replica_parallel=replica_parallel)))
  return ocp.PyTreeCheckpointHandler(type_handler_registry=registry, use_compression=compress)


def directory_of(workdir: str) -> str:
  return storage.join(workdir, 'checkpoints')


def exists_on_process_0(workdir: str) -> bool:
  """Whether workdir/checkpoints exists, as process 0 sees it: one answer for every host."""
  exists = storage.path(directory_of(workdir)).is_dir()
  if jax.process_count() == 1:
    return exists
  return bool(multihost_utils.broadcast_one_to_all(np.array(exists)))


def _fsync(path: str, flags: int = os.O_RDONLY) -> None:
  fd = os.open(path, flags)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _fsync_tree(path: str) -> None:
  """fsyncs every file and folder under `path`, and its parent folder."""
  for folder, _, files in os.walk(path):
    for name in files:
      _fsync(os.path.join(folder, name))
    _fsync(folder, os.O_RDONLY | os.O_DIRECTORY)
  _fsync(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)


class _DurableRename(atomicity.AtomicRenameTemporaryPath):
  """Orbax's save-then-rename on a local disk, made durable: the step's files and folders
  are fsync'd as soon as it is renamed into place. Without it the newest step's small
  metadata files live only in the page cache for seconds (ext4 delays writing file data),
  and a disk that fails or a host that loses power then leaves them empty: the restart
  finds its newest step damaged."""

  async def finalize(self):
    await super().finalize()
    await asyncio.to_thread(_fsync_tree, os.fspath(self.get_final()))


def make_manager(workdir: str, keep: int, use_async: bool, replica_parallel: bool = False,
                 compress: bool = True) -> ocp.CheckpointManager:
  """A manager for `workdir/checkpoints`; incomplete (killed) saves are cleaned up.

  `compress=False` bounds a save's host memory beyond the state to about one array (see
  _handler).
  """
  options = ocp.CheckpointManagerOptions(
      preservation_policy=ocp.checkpoint_managers.LatestN(keep),
      enable_async_checkpointing=use_async, cleanup_tmp_directories=True, create=True,
      single_host_load_and_broadcast=True,  # Every host sees process 0's list of steps.
      temporary_path_class=None if storage.is_remote(workdir) else _DurableRename)
  return ocp.CheckpointManager(directory_of(workdir),
                               item_handlers=_handler(replica_parallel, compress),
                               options=options)


def _mismatches(saved, wanted, only_wanted=False):
  """Lines naming each path whose shape differs, params first."""
  params_first = lambda paths: sorted(paths, key=lambda p: (not p.startswith('params.'), p))
  problems = [f'{p}: checkpoint {saved[p]} vs config {wanted[p]}'
              for p in params_first(saved.keys() & wanted.keys()) if saved[p] != wanted[p]]
  if not only_wanted:
    problems += [f'{p}: only in the checkpoint' for p in params_first(saved.keys() - wanted.keys())]
  problems += [f'{p}: missing from the checkpoint'
               for p in params_first(wanted.keys() - saved.keys())]
  more = f'; and {len(problems) - 12} more' if len(problems) > 12 else ''
  shown = '; '.join(problems[:12]) + more
  return len(problems), shown


def _all_processes(ok):
  """True only if `ok` holds on every process, so that all take the same branch."""
  if jax.process_count() == 1:
    return ok
  return bool(np.all(multihost_utils.process_allgather(np.array(ok))))


def _one_line(error):
  text = str(error).strip().splitlines()
  return f'{type(error).__name__}: {text[0] if text else ""}'[:300]


def restore_latest(manager: ocp.CheckpointManager, target: dict,
                   fallback: bool) -> tuple[Optional[dict], Optional[int]]:
  """Restores the newest complete step into `target`; returns (tree, step) or (None, None).

  A checkpoint that does not fit `target` raises CheckpointError listing the paths. A
  damaged one (unreadable metadata or data) raises CheckpointError and changes nothing on
  disk; with `fallback`, it is renamed to `<step>.damaged` (kept for inspection, and out
  of the way of the run that will write that step again) and the next older step is tried.
  Every process takes the same decision, even when only one of them read a bad file.
  """
  steps = sorted(manager.all_steps(), reverse=True)
  for i, step in enumerate(steps):
    tree, error = None, None
    try:
      saved = _shapes(manager.item_metadata(step))
    except Exception as e:  # pylint: disable=broad-except  # Orbax raises many types.
      saved, error = None, e
    if _all_processes(saved is not None):
      count, shown = _mismatches(saved, _shapes(target))
      if count:
        raise CheckpointError(
            f'checkpoint step {step} in {manager.directory} does not match the configured model '
            f'or optimizer ({count} arrays): {shown}. Use the config it was written with, or '
            'another --workdir')
      try:
        tree = manager.restore(step, args=restore_args(target))
      except Exception as e:  # pylint: disable=broad-except  # Orbax/tensorstore raise many types.
        error = e
    if _all_processes(error is None):
      return tree, step
    reason = _one_line(error) if error is not None else 'unreadable on another process'
    older = steps[i + 1] if i + 1 < len(steps) else None
    if not fallback or older is None:
      hint = (f'set --config.checkpoint.fallback=True to resume from step {older}, or delete it'
              if older is not None else 'delete it to start afresh')
      raise CheckpointError(f'checkpoint step {step} in {manager.directory} is damaged '
                            f'({reason}); {hint}') from error
    logging.warning('checkpoint step %d is damaged (%s); moved aside, falling back to step %d',
                    step, reason, older)
    _move_aside(manager, step)
  return None, None


def _move_aside(manager, step):
  """Renames a damaged step directory (on process 0) so that the step can be saved again."""
  path = storage.path(manager.directory) / str(step)
  if jax.process_index() == 0:
    suffix = 0
    while path.with_name(f'{step}.damaged' + (f'.{suffix}' if suffix else '')).exists():
      suffix += 1
    path.rename(path.with_name(f'{step}.damaged' + (f'.{suffix}' if suffix else '')))
  multihost_utils.sync_global_devices(f'zoo_move_aside_{step}')
  manager.reload()


def latest_metadata(directory: str) -> Any:
  """The tree of shapes and dtypes of the newest checkpoint in `directory` (read-only)."""
  with ocp.CheckpointManager(directory, item_handlers=_handler(),
                             options=ocp.CheckpointManagerOptions(read_only=True)) as manager:
    return manager.item_metadata(manager.latest_step())


def restore_params(path: str, params_target: Any,
                   field: str = 'config.checkpoint.init_from') -> tuple[Any, int, str]:
  """Params only, from another run's workdir or checkpoint directory (its latest step)."""
  directory = storage.path(path)
  if (directory / 'checkpoints').is_dir():
    directory = directory / 'checkpoints'
  directory = str(directory)
  if not storage.path(directory).is_dir():
    raise CheckpointError(f'{field}: {path} is not a directory; give a '
                          'run\'s workdir or its checkpoints/ directory')
  with ocp.CheckpointManager(directory, item_handlers=_handler(),
                             options=ocp.CheckpointManagerOptions(read_only=True)) as source:
    step = source.latest_step()
    if step is None:
      raise CheckpointError(f'{field}: no complete checkpoint in {directory}')
    target = {'params': params_target}
    count, shown = _mismatches(_shapes(source.item_metadata(step)), _shapes(target),
                               only_wanted=True)
    if count:
      raise CheckpointError(f'{field}: step {step} in {directory} does not '
                            f'match the configured model: {shown}')
    restored = source.restore(step, args=ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
        partial_restore=True))
  return restored['params'], step, directory


def _without(params: Any, fresh: Callable[[tuple], bool]) -> tuple[dict, dict]:
  """(params but the `fresh` ones, the fresh ones), by their paths of names."""
  flat = flax.traverse_util.flatten_dict(params)
  unflat = flax.traverse_util.unflatten_dict
  return (unflat({k: v for k, v in flat.items() if not fresh(k)}),
          unflat({k: v for k, v in flat.items() if fresh(k)}))


def restore_or_init(workdir: str, abstract: Any, create: Callable[[], Any],
                    c: ml_collections.ConfigDict,
                    fresh: Optional[Callable[[tuple], bool]] = None
                    ) -> tuple[Any, ocp.CheckpointManager]:
  """The run's first state: the newest checkpoint in the workdir, else `create()` (with
  `c.init_from`'s params, if set; the parameters `fresh` names, LoRA's adapters, keep their
  initial values: the source has none). Returns (state, checkpoint manager). `abstract` is
  the state's shapes with their shardings; `c` the config's checkpoint section.

  Restores read straight into those shardings, whatever mesh wrote the checkpoint.
  A checkpoint (or init_from) that does not fit fails before anything is written.
  """
  target = saved_tree(abstract)
  new_manager = lambda: make_manager(workdir, c.keep, c.async_save, c.replica_parallel)
  manager = None
  if exists_on_process_0(workdir):
    manager = new_manager()
    restored, step = restore_latest(manager, target, c.fallback)
    if restored is not None:
      logging.info('resuming from step %d of %s', step, manager.directory)
      return abstract.replace(**restored), manager
    logging.info('no complete checkpoint in %s: starting at step 0', manager.directory)
  state = create()
  if c.init_from:
    wanted = _without(target['params'], fresh)[0] if fresh else target['params']
    params, step, source = restore_params(c.init_from, wanted)
    if fresh:
      kept = _without(state.params, fresh)[1]
      params = flax.traverse_util.unflatten_dict({**flax.traverse_util.flatten_dict(params),
                                                  **flax.traverse_util.flatten_dict(kept)})
    logging.info('initialised params from step %d of %s (optimizer state%s fresh)', step, source,
                 ' and adapters' if fresh else '')
    state = state.replace(params=params)
  return state, manager or new_manager()


class Saver:
  """Saves steps through `manager` and turns a failed save into one CheckpointError.

  An async save fails in the background; orbax raises its error at the next save or wait.
  Either way the error names the step that failed, the path and the cause (no space, no
  permission, storage unreachable); that step's partial directory is removed, and every
  earlier step and metrics.jsonl stay as they were, so the next run resumes from the newest
  complete step.
  """

  def __init__(self, manager: ocp.CheckpointManager):
    self.manager = manager
    self.in_flight: Optional[int] = None  # The step of an async save not yet known complete.
    self.failed = False

  def save(self, step: int, state: Any) -> None:
    self.wait()  # Orbax waits for the previous save anyway; this way a failure names its step.
    with self._failures(step):
      self.manager.save(step, args=save_args(saved_tree(state)), force=True)
    self.in_flight = step
    logging.info('saving checkpoint step %d to %s', step, self.manager.directory)

  def wait(self) -> None:
    """Blocks until the last save is complete (or raises its failure)."""
    if self.in_flight is not None and not self.failed:
      with self._failures(self.in_flight):
        self.manager.wait_until_finished()
      self.in_flight = None

  def close(self) -> None:
    """Waits for the last save, then closes the manager; after a failure, closing errors
    (orbax re-raising it) are logged, not raised over the CheckpointError."""
    try:
      self.wait()
    finally:
      try:
        self.manager.close()
      except Exception as e:  # pylint: disable=broad-except
        if not self.failed:
          raise
        logging.warning('closing the checkpoint manager after a failed save: %s', _one_line(e))

  @contextlib.contextmanager
  def _failures(self, step):
    try:
      yield
    except Exception as e:  # pylint: disable=broad-except  # Orbax/tensorstore raise many types.
      self.failed, failed_step = True, step
      directory = str(self.manager.directory)
      removed = _remove_partial(directory, failed_step)
      kept = sorted(s for s in _complete_steps(directory) if s != failed_step)
      resume = f'the next run resumes from step {kept[-1]}' if kept else 'no earlier checkpoint'
      raise CheckpointError(
          f'saving checkpoint step {failed_step} to {directory} failed ({_storage_cause(e)}); '
          f'{"removed its partial files; " if removed else ""}earlier checkpoints and '
          f'metrics.jsonl are intact ({resume}). Free space or fix access to the storage, '
          'then run again') from e


def _complete_steps(directory: str) -> list[int]:
  try:
    return [int(d) for d in storage.listdir(directory) if d.isdigit()]
  except OSError:
    return []


def _remove_partial(directory: str, step: Optional[int]) -> bool:
  """Process 0 deletes `step`'s unfinished (tmp) directories; True if it found any."""
  if step is None or jax.process_index() != 0:
    return False
  found = False
  try:
    names = storage.listdir(directory)
  except OSError:
    return False
  for name in names:
    if name.startswith(f'{step}.orbax-checkpoint-tmp'):
      found = True
      with contextlib.suppress(OSError):
        (storage.path(directory) / name).rmtree()
  return found


def _storage_cause(error: BaseException) -> str:
  """The root cause of a storage error, short: the innermost OSError, or a storage status
  with the message's last clause (tensorstore: 'RESOURCE_EXHAUSTED: Error writing ... in
  OCDBT database ...: Failed to write N bytes to file F: No space left on device [...]'
  becomes 'RESOURCE_EXHAUSTED: No space left on device')."""
  chain, seen = [], set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    chain.append(error)
    error = error.__cause__ or error.__context__
  for e in reversed(chain):
    if isinstance(e, OSError) and e.strerror:
      return f'{e.strerror}{": " + str(e.filename) if e.filename else ""}'
  for e in chain:
    text = first_line(e)
    status = re.match(r'([A-Z_]{5,}): ', text)
    if status:
      last = re.sub(r'\s*\[[^\]]*\]$', '', text).rsplit(': ', 1)[-1]
      return f'{status.group(1)}: {last}'[:200]
  return _one_line(chain[0])


class StopRequest:
  """Callable step -> bool: should the run save now and exit (SIGTERM, preemption)?

  Multi-process runs use orbax's preemption sync point, so that every host stops at the
  same step. A single process has no coordination service: a SIGTERM handler sets a flag.
  """

  def __init__(self, manager):
    self._manager = manager
    self._received = False
    self._previous = None
    if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

  def _on_sigterm(self, signum, frame):
    del signum, frame
    self._received = True

  def __call__(self, step):
    return self._received or self._manager.reached_preemption(step)

  def close(self) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None
