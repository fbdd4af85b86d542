"""Datasets and the assembly of global batches from each process's rows.

A batch is a dict of numpy arrays with a leading batch axis: `inputs`, `targets`,
`decoder_inputs` for sequence-to-sequence data, and for eval batches `weights` (0 marks
padding). Batch contents are a pure function of
(seed, step), so the step alone is the data position of a run: resuming needs no
iterator state, and every process computes the same global batch order.
"""
import dataclasses
import queue
import threading
from typing import Callable, Iterator, Optional

import jax
import numpy as np

from zoo.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Dataset:
  """What the trainer needs of a dataset. `rows` selects this process's slice of a batch."""
  task: str                 # 'classification', 'lm' or 'seq2seq': the models that consume it.
  model_fields: dict        # Fields the model takes from the data, e.g. {'num_classes': 10}.
  # (step, global_batch_size, rows) -> local batch; a pure function of seed and step.
  train_batch: Callable[[int, int, slice], dict]
  # (global_batch_size, rows) -> local eval batches covering the eval split once.
  eval_batches: Callable[[int, slice], Iterator[dict]]
  num_train: int            # Training examples (windows for text; unbounded if generated).
  decode: Optional[Callable[[np.ndarray], str]] = None   # Token ids -> text (sequences).
  encode: Optional[Callable[[str], np.ndarray]] = None   # Text -> token ids (LM only).


# name -> task, so a config can be checked against its model before any data loads
# (None: the file decides, checked once it is loaded).
DATASETS = {'digits': 'classification', 'text': 'lm', 'seq': 'seq2seq', 'npz': None}


def load(data_config, seed):
  """The dataset named by `data_config.name`."""
  from zoo.data import digits, npz, seq, text  # pylint: disable=import-outside-toplevel
  loaders = {'digits': digits.load, 'text': text.load, 'seq': seq.load, 'npz': npz.load}
  return loaders[data_config.name](data_config, seed)


def process_rows(batch_sharding, global_batch_size):
  """The contiguous rows of a global batch that this process's devices hold."""
  indices = batch_sharding.addressable_devices_indices_map((global_batch_size,)).values()
  starts = [idx[0].start or 0 for idx in indices]
  stops = [global_batch_size if idx[0].stop is None else idx[0].stop for idx in indices]
  rows = slice(min(starts), max(stops))
  covered = sum(s1 - s0 for s0, s1 in sorted(set(zip(starts, stops))))
  if covered != rows.stop - rows.start:
    raise ConfigError(f'config.mesh.shape: this process holds non-contiguous rows of the batch '
                      f'{sorted(set(zip(starts, stops)))}; choose a shape whose batch axis gives each '
                      'process one block of rows')
  return rows


def to_global(local_batch, batch_sharding, global_batch_size):
  """Global jax.Arrays from this process's rows of every field of a batch."""
  def one(x):
    return jax.make_array_from_process_local_data(
        batch_sharding, x, (global_batch_size,) + x.shape[1:])
  return jax.tree.map(one, local_batch)


class Prefetch:
  """`make(step)` for steps [start, stop), built `depth` steps ahead on a background thread.

  Assembling a batch on the host and copying it onto the devices then overlap the steps
  that run before it, and go on while the loop waits to log, evaluate or save. `get`
  returns the batches in step order and re-raises the thread's error. depth 0 builds
  each batch when it is asked for.
  """

  def __init__(self, make, start, stop, depth):
    self._make, self._next, self._depth = make, start, depth
    self._queue = queue.Queue(maxsize=max(depth, 1))
    self._closed = threading.Event()
    self._thread = None
    if depth:
      self._thread = threading.Thread(target=self._fill, args=(start, stop), daemon=True,
                                      name='zoo-prefetch')
      self._thread.start()

  def _fill(self, start, stop):
    for step in range(start, stop):
      try:
        item = (step, self._make(step))
      except BaseException as e:  # pylint: disable=broad-except
        item = (step, e)
      while not self._closed.is_set():
        try:
          self._queue.put(item, timeout=0.1)
          break
        except queue.Full:
          continue
      if self._closed.is_set() or isinstance(item[1], BaseException):
        return

  def get(self, step):
    if not self._depth:
      return self._make(step)
    while True:
      try:
        got, batch = self._queue.get(timeout=1.0)
        break
      except queue.Empty:
        if not self._thread.is_alive() and self._queue.empty():  # Its last put may be late.
          raise RuntimeError(f'the prefetch thread stopped before step {step}') from None
    if isinstance(batch, BaseException):
      raise batch
    assert got == step, f'prefetched step {got}, expected {step}'
    return batch

  def close(self):
    self._closed.set()
    if self._thread is not None:
      self._thread.join(timeout=10)


def epoch_order(seed, num_examples, step, global_batch_size):
  """Example indices of the global batch at `step`: a fresh permutation per epoch.

  Each epoch drops its last partial batch, so every step sees a full batch of
  distinct examples on every process.
  """
  steps_per_epoch = num_examples // global_batch_size
  epoch, index = divmod(step, steps_per_epoch)
  perm = np.random.default_rng([seed, epoch]).permutation(num_examples)
  return perm[index * global_batch_size:(index + 1) * global_batch_size]


def padded_batches(arrays, global_batch_size, rows):
  """Slices `arrays` (equal lengths) into global batches, zero-padding the last one.

  Yields this process's rows of each batch with a `weights` field, 0 on padding,
  so every eval example counts exactly once on every mesh.
  """
  n = len(next(iter(arrays.values())))
  for start in range(0, n, global_batch_size):
    idx = np.arange(start, start + global_batch_size)[rows]
    valid = idx < n
    idx = np.where(valid, idx, 0)
    batch = {k: v[idx] for k, v in arrays.items()}
    batch['weights'] = valid.astype(np.float32)
    yield batch
