"""From a dataset's rows to global arrays on the devices: which rows this process builds,
their assembly into global jax.Arrays, and prefetching on a background thread."""
import contextlib
import dataclasses
import itertools
import queue
import threading
from typing import Any, Callable, Iterator, Optional, Union

import jax

from zoo.data.dataset import Dataset
from zoo.errors import ConfigError
from zoo.parallel import context


def rows_by_process(batch_sharding: jax.sharding.NamedSharding,
                    global_batch_size: int) -> dict[int, slice]:
  """process index -> the contiguous rows of a global batch that its devices hold (for
  every process of the mesh, compile-only pod devices too); ConfigError if a process's
  rows are not one block."""
  spans = {}
  for device, index in batch_sharding.devices_indices_map((global_batch_size,)).items():
    start, stop = index[0].indices(global_batch_size)[:2]
    spans.setdefault(device.process_index, set()).add((start, stop))
  rows = {}
  for process, blocks in sorted(spans.items()):
    first, last = min(a for a, _ in blocks), max(b for _, b in blocks)
    if sum(b - a for a, b in blocks) != last - first:
      raise ConfigError(f'config.mesh.shape: process {process} holds non-contiguous rows of the '
                        f'batch {sorted(blocks)}; choose a shape whose batch axis gives each '
                        'process one block of rows')
    rows[process] = slice(first, last)
  return rows


def process_rows(batch_sharding: Union[jax.sharding.NamedSharding, 'Placement'],
                 global_batch_size: int) -> slice:
  """The contiguous rows of a global batch that this process's devices hold."""
  if isinstance(batch_sharding, Placement):
    batch_sharding = batch_sharding.rows
  return rows_by_process(batch_sharding, global_batch_size)[jax.process_index()]


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where each field of a global batch lies on the mesh: its rows over the batch axes
  (`rows`). Where the sequence is split (context parallelism) and the rows are fed in its
  load-balanced order, the fields that run along the `length` positions are split over
  the context axes too (`cells`): each device then receives only its slice of them, and
  each process places only its devices' slices of its rows."""
  rows: jax.sharding.NamedSharding
  cells: Optional[jax.sharding.NamedSharding] = None
  length: int = 0

  def of(self, shape: tuple) -> jax.sharding.NamedSharding:
    """The sharding of a global field of `shape` ([rows, ...])."""
    along = self.cells is not None and context.along_sequence(shape, self.length)
    return self.cells if along else self.rows

  def shardings(self, batch: dict) -> Any:
    """jax.jit's in_shardings for a batch with `batch`'s fields: the rows' sharding (a
    prefix of every field) where no field is split along the sequence."""
    if self.cells is None:
      return self.rows
    return {k: self.of(v.shape) for k, v in batch.items()}

  def blocks(self, global_batch_size: int) -> dict:
    """What each process feeds of a global batch: {'rows': {process: [start, stop]}}; where
    fields are split along the sequence, also {'positions': {process: [[start, stop],
    ...]}}, the spans of positions (in their fed, load-balanced order) that it places."""
    fed = {'rows': {p: [r.start, r.stop] for p, r in
                    rows_by_process(self.rows, global_batch_size).items()}}
    if self.cells is not None:
      held = {}
      for device, index in self.cells.devices_indices_map(
          (global_batch_size, self.length)).items():
        held.setdefault(device.process_index, set()).add(index[1].indices(self.length)[:2])
      fed['positions'] = {p: _merged(spans) for p, spans in sorted(held.items())}
    return fed


def _merged(spans: set) -> list[list[int]]:
  """[start, stop) spans, those that touch joined, in order."""
  out = []
  for start, stop in sorted(spans):
    if out and start <= out[-1][1]:
      out[-1][1] = max(out[-1][1], stop)
    else:
      out.append([start, stop])
  return out


def to_global(local_batch: dict,
              batch_sharding: Union[jax.sharding.NamedSharding, Placement],
              global_batch_size: int) -> dict:
  """Global jax.Arrays from this process's rows of every field of a batch. Under a
  Placement, each field split along the sequence goes to each device as only its slice
  (wherever along the sequence this process's devices lie)."""
  placement = (batch_sharding if isinstance(batch_sharding, Placement)
               else Placement(batch_sharding))
  first = 0 if placement.cells is None else process_rows(placement, global_batch_size).start
  def one(x):
    shape = (global_batch_size,) + x.shape[1:]
    where = placement.of(shape)
    if where is placement.rows:
      return jax.make_array_from_process_local_data(where, x, shape)
    def cut(index):  # A device's global index -> its slice of this process's rows.
      rows = slice(*(i - first for i in index[0].indices(global_batch_size)[:2]))
      return x[(rows,) + tuple(index[1:])]
    return jax.make_array_from_callback(shape, where, cut)
  return jax.tree.map(one, local_batch)


def as_is(batch: dict) -> dict:
  """A local batch unchanged: the default `arrange`."""
  return batch


class TrainBatches:
  """step -> the global train batch of that step, built from this process's rows; asked
  for in step order from `start` when the dataset builds its batches ahead
  (Dataset.train_iterator, e.g. in worker processes). `close` stops those workers."""

  def __init__(self, dataset: Dataset,
               batch_sharding: Union[jax.sharding.NamedSharding, Placement],
               global_batch_size: int, start: int = 0,
               arrange: Callable[[dict], dict] = as_is):
    """`arrange`: what each local batch goes through before it is placed (Setup.arrange:
    context parallelism's load-balanced order)."""
    self.dataset, self.sharding, self.size = dataset, batch_sharding, global_batch_size
    self.arrange = arrange
    self.rows = process_rows(batch_sharding, global_batch_size)
    self.next_step, self.local = start, None
    if dataset.train_iterator is not None:
      self.local = dataset.train_iterator(start, global_batch_size, self.rows)

  def __call__(self, step: int) -> dict:
    if self.local is None:
      local = self.dataset.train_batch(step, self.size, self.rows)
    else:
      assert step == self.next_step, f'asked for step {step}, the workers build {self.next_step}'
      local = next(self.local)
      self.next_step += 1
    return to_global(self.arrange(local), self.sharding, self.size)

  def close(self) -> None:
    if hasattr(self.local, 'close'):
      self.local.close()


def eval_batches(batches: Callable[[int, slice], Iterator[dict]],
                 batch_sharding: Union[jax.sharding.NamedSharding, Placement],
                 global_batch_size: int, max_batches: int = 0,
                 arrange: Callable[[dict], dict] = as_is) -> Iterator[dict]:
  """The global eval batches of `batches` (a Dataset's eval_batches: (global batch size,
  rows) -> local batches), the first `max_batches` (0: all), each example once, each
  through `arrange` (as TrainBatches's) first."""
  rows = process_rows(batch_sharding, global_batch_size)
  for local in itertools.islice(batches(global_batch_size, rows), max_batches or None):
    yield to_global(arrange(local), batch_sharding, global_batch_size)


class Prefetch:
  """`make(step)` for steps [start, stop), built `depth` steps ahead on a background thread.

  Assembling a batch on the host and copying it onto the devices then overlap the steps
  that run before it, and go on while the loop waits to log, evaluate or save. `get`
  returns the batches in step order and re-raises the thread's error; inside `quiet()` the
  thread starts no batch. depth 0 builds each batch when it is asked for.
  """

  def __init__(self, make: Callable[[int], dict], start: int, stop: int, depth: int):
    self._make, self._depth = make, depth
    self._queue = queue.Queue(maxsize=max(depth, 1))
    self._closed = threading.Event()
    self._go = threading.Event()   # Cleared inside quiet().
    self._go.set()
    self._making = threading.Lock()  # Held while the thread builds a batch.
    self._thread = None
    if depth:
      self._thread = threading.Thread(target=self._fill, args=(start, stop), daemon=True,
                                      name='zoo-prefetch')
      self._thread.start()

  def _next(self, step):
    """(step, batch or its error) once the loop is not quiet; None once closed."""
    while not self._closed.is_set():
      with self._making:
        if self._go.is_set():  # Checked under the lock: quiet() waits for this batch.
          try:  # Until its copies have reached the devices: quiet() waits for them.
            return step, jax.block_until_ready(self._make(step))
          except BaseException as e:  # pylint: disable=broad-except
            return step, e
      self._go.wait(timeout=0.1)
    return None

  def _fill(self, start, stop):
    for step in range(start, stop):
      item = self._next(step)
      while item is not None and not self._closed.is_set():
        try:
          self._queue.put(item, timeout=0.1)
          break
        except queue.Full:
          continue
      if item is None or self._closed.is_set() or isinstance(item[1], BaseException):
        return

  @contextlib.contextmanager
  def quiet(self):
    """While held, the thread builds and copies no batch (one it was building is finished
    first, its copies on the devices): a program's first execution then has the devices'
    streams to itself."""
    self._go.clear()
    with self._making:
      pass
    try:
      yield
    finally:
      self._go.set()

  def get(self, step: int) -> dict:
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

  def close(self) -> None:
    self._closed.set()
    if self._thread is not None:
      self._thread.join(timeout=10)
