"""What a dataset gives the trainer, and the builders that in-memory datasets share.

A batch is a dict of numpy arrays with a leading batch axis: `inputs`, `targets`,
`decoder_inputs` for sequence-to-sequence data, for packed documents `segments`,
`positions` and `mask` (per target: 0 counts nowhere), and for eval batches `weights`
(per example: 0 marks a padded row). Batch contents are a pure function of (seed, step), so the step alone is the
data position of a run: resuming needs no iterator state, and every process computes the
same global batch order.
"""
import dataclasses
import io
import json
import os
from typing import Any, Callable, Iterator, Optional

import ml_collections
import numpy as np

from zoo.errors import ConfigError
from zoo.store import storage

METADATA = 'metadata.json'  # Written last into a prepared dataset's directory.


@dataclasses.dataclass(frozen=True)
class Reference:
  """Per-example figures of a reference model that a dataset's batches carry (preference
  pairs: each completion's log-probability, `reference` [B, 2]), computed once by the run
  (zoo.run.reference) and filled in place: `tables` split -> [N, ...] float32, NaN until
  then; `batches` split -> (global_batch_size, rows) -> the split's batches in example
  order, padded with `weights` (what the reference model scores)."""
  tables: dict
  batches: dict


@dataclasses.dataclass(frozen=True)
class Dataset:
  """What the trainer needs of a dataset. `rows` selects this process's slice of a batch."""
  task: str                 # A key of zoo.run.tasks.TASKS: the models that consume it.
  model_fields: dict        # Fields the model takes from the data, e.g. {'num_classes': 10}.
  # (step, global_batch_size, rows) -> local batch; a pure function of seed and step.
  train_batch: Callable[[int, int, slice], dict]
  # (global_batch_size, rows) -> local eval batches covering the eval split once.
  eval_batches: Callable[[int, slice], Iterator[dict]]
  num_train: int            # Training examples (windows for text; unbounded if generated).
  decode: Optional[Callable[[np.ndarray], str]] = None   # Token ids -> text (sequences).
  encode: Optional[Callable[[str], np.ndarray]] = None   # Text -> token ids (LM only).
  # What one token of a language dataset is: eval reports bits per `token_unit` ('char' for
  # character text, 'token' for a tokenizer's); eval batches with a `bytes` field (UTF-8
  # bytes per target) add bits per byte.
  token_unit: str = 'char'
  # (start step, global_batch_size, rows) -> this process's batches of steps start, start+1,
  # ...: the same batches as train_batch, built ahead (e.g. in worker processes); None: by
  # train_batch, one step at a time.
  train_iterator: Optional[Callable[[int, int, slice], Iterator[dict]]] = None
  # -> training examples this process has read so far (datasets read from files).
  examples_read: Optional[Callable[[], int]] = None
  # name -> (global_batch_size, rows) -> eval batches: the eval split's parts (a mixture's
  # sources), reported each on its own and together; eval_batches is all of them.
  eval_sources: Optional[dict[str, Callable[[int, slice], Iterator[dict]]]] = None
  # The token that ends each document, and so is the input before a document's first token
  # (packed token data); None: the data has none.
  eos_id: Optional[int] = None
  # Chat data: the token ids of a held-out conversation's opening, up to the generation
  # prompt, that each eval's sample continues (else the first quarter of a held-out
  # window), and the ids that end the reply there.
  sample_prompt: Optional[list] = None
  stop_ids: tuple = ()
  # Figures of a reference model that the batches carry (preference pairs); None: none.
  reference: Optional[Reference] = None
  # Prompts for reinforcement learning: split -> each prompt's other fields (dicts, by the
  # batches' `index`), which the reward functions get by name.
  records: Optional[dict] = None


def _no_check(data_config: ml_collections.ConfigDict) -> None:
  del data_config


@dataclasses.dataclass(frozen=True)
class DataSource:
  """A kind of data that `config.data.name` names (see zoo.data.DATASETS)."""
  load: Callable[[ml_collections.ConfigDict, int], Dataset]   # (config.data, seed) -> Dataset.
  # Its task, so that a config is checked before loading; None: the file decides.
  task: Optional[str]
  # (config.data) -> None: checks its own fields before loading; raises through errors.fail.
  check_config: Callable[[ml_collections.ConfigDict], None] = _no_check
  # (config.data, seed) -> a Dataset of the shapes a plan (--dry_run) compiles for, where
  # the data at hand need not hold a batch (a pod's 131k-token windows); None: `load`.
  plan_load: Optional[Callable[[ml_collections.ConfigDict, int], Dataset]] = None


def read_metadata(path: str, fmt: str, versions: tuple[int, ...], kind: str,
                  field: str = 'config.data.path') -> dict:
  """The metadata.json of a dataset directory that `python -m zoo.prepare <kind>` wrote in
  format `fmt`, one of `versions` (the last is what this zoo writes); ConfigError naming
  `field` (where the path came from) and the fix."""
  prepare = f'`python -m zoo.prepare {kind}`'
  if storage.is_remote(path):
    storage.check_bucket(path, field)
  if not storage.is_dir(path):
    raise ConfigError(f'{field}: {path} is not a directory; give a dataset that '
                      f'{prepare} wrote')
  meta_path = storage.join(path, METADATA)
  if not storage.is_file(meta_path):
    raise ConfigError(f'{field}: {path} has no {METADATA}: it is not a prepared '
                      f'dataset, or its preparation did not finish; run {prepare} again')
  try:
    meta = json.loads(storage.read_text(meta_path))
  except ValueError as e:
    raise ConfigError(f'{field}: {meta_path} is not valid JSON ({e}); prepare the '
                      'dataset again') from None
  if meta.get('format') != fmt:
    raise ConfigError(f'{field}: {path} holds {meta.get("format")!r} data, not '
                      f'{fmt!r}; give a directory that {prepare} wrote')
  if meta.get('version') not in versions:
    raise ConfigError(f'{field}: {path} was prepared by format version '
                      f'{meta.get("version")}, but this zoo reads version '
                      f'{" or ".join(map(str, versions))}; prepare it '
                      'again with this zoo')
  return meta


def write_arrays(directory: str, name: str, **arrays: np.ndarray) -> None:
  """`name`.npz in a dataset directory being written (preference pairs, prompts)."""
  buffer = io.BytesIO()
  np.savez(buffer, **arrays)
  with open(os.path.join(directory, f'{name}.npz'), 'wb') as f:
    f.write(buffer.getvalue())


def read_arrays(path: str, name: str) -> dict:
  """The arrays of `name`.npz in a dataset directory (local or in a bucket)."""
  with np.load(io.BytesIO(storage.read_bytes(storage.join(path, f'{name}.npz')))) as f:
    return dict(f)


def finish(directory: str, tokenizer: Any, meta: dict) -> dict:
  """Writes the tokenizer and, last, metadata.json (what makes the directory a dataset)."""
  with open(os.path.join(directory, 'tokenizer.json'), 'w', encoding='utf-8') as f:
    f.write(tokenizer.to_str())
  with open(os.path.join(directory, METADATA), 'w', encoding='utf-8') as f:
    json.dump(meta, f, indent=2)
  return meta


def epoch_order(seed: int, num_examples: int, step: int, global_batch_size: int) -> np.ndarray:
  """Example indices of the global batch at `step`: a fresh permutation per epoch.

  Each epoch drops its last partial batch, so every step sees a full batch of
  distinct examples on every process.
  """
  steps_per_epoch = num_examples // global_batch_size
  epoch, index = divmod(step, steps_per_epoch)
  perm = np.random.default_rng([seed, epoch]).permutation(num_examples)
  return perm[index * global_batch_size:(index + 1) * global_batch_size]


def padded_rows(n: int, global_batch_size: int, rows: slice) -> Iterator[tuple]:
  """Example indices of eval batches over n examples, this process's rows of each: yields
  (indices, weights), the last batch padded with index 0 and weight 0, so every example
  counts exactly once on every mesh."""
  for start in range(0, n, global_batch_size):
    idx = np.arange(start, start + global_batch_size)[rows]
    valid = idx < n
    yield np.where(valid, idx, 0), valid.astype(np.float32)


def padded_batches(arrays: dict, global_batch_size: int, rows: slice) -> Iterator[dict]:
  """Eval batches of in-memory `arrays` (equal lengths), with `weights` (see padded_rows)."""
  n = len(next(iter(arrays.values())))
  for idx, weights in padded_rows(n, global_batch_size, rows):
    yield {**{k: v[idx] for k, v in arrays.items()}, 'weights': weights}


def arrays_dataset(x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray,
                   y_test: np.ndarray, seed: int, num_classes: int) -> Dataset:
  """A classification Dataset over in-memory arrays: a fresh permutation per epoch."""
  def train_batch(step, global_batch_size, rows):
    idx = epoch_order(seed, len(y_train), step, global_batch_size)[rows]
    return {'inputs': x_train[idx], 'targets': y_train[idx]}

  def eval_batches(global_batch_size, rows):
    return padded_batches({'inputs': x_test, 'targets': y_test}, global_batch_size, rows)

  return Dataset(task='classification', model_fields={'num_classes': num_classes},
                 train_batch=train_batch, eval_batches=eval_batches, num_train=len(y_train))


def token_windows(train: np.ndarray, held_out: np.ndarray, seq_len: int, seed: int,
                  vocab_size: int, decode: Callable, encode: Optional[Callable] = None) -> Dataset:
  """A language-modelling Dataset over two 1-D token arrays.

  Training windows start at random positions, a function of (seed, step); eval windows
  tile the held-out tokens without overlap.
  """
  window = seq_len + 1

  def train_batch(step, global_batch_size, rows):
    starts = np.random.default_rng([seed, step]).integers(
        0, len(train) - window + 1, size=global_batch_size)[rows]
    w = train[starts[:, None] + np.arange(window)]
    return {'inputs': w[:, :-1], 'targets': w[:, 1:]}

  def eval_batches(global_batch_size, rows):
    n = len(held_out) // window
    w = held_out[:n * window].reshape(n, window)
    return padded_batches({'inputs': w[:, :-1], 'targets': w[:, 1:]}, global_batch_size, rows)

  return Dataset(task='lm', model_fields={'vocab_size': vocab_size},
                 train_batch=train_batch, eval_batches=eval_batches,
                 num_train=len(train) // window, decode=decode, encode=encode)
