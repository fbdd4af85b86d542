"""Token datasets: fixed-width token shards on disk, read at random, each process its rows.

`data.name = 'tokens'`, `data.path = DIR`, a directory that `python -m zoo.prepare text`
wrote:

    metadata.json     format and version, vocabulary, token dtype, per split: tokens,
                      documents, UTF-8 bytes and shards
    tokenizer.json    the tokenizer (Hugging Face `tokenizers`): prompts and samples
    token_bytes.npy   UTF-8 bytes per token id: eval's bits per byte
    train-00000.bin   little-endian uint16 tokens (uint32 if the vocabulary exceeds 65,536),
    val-00000.bin     documents one after another, each ended by the end-of-document token
    train-documents.npy, val-documents.npy
                      int64: where each document ends (the offset after its last token)

`data.windows` cuts the split into training examples:
- 'documents' (the default): documents packed into windows of seq_len targets, attention
  and positions per document, padding masked (zoo.data.packing); an epoch is a
  permutation of the windows drawn from (seed, epoch);
- 'stream': the window of seq_len + 1 tokens at a position drawn from (seed, step) for
  each row, across document boundaries (how zoo read tokens before format version 2).
A process reads only its rows' windows, so memory does not grow with the data and resuming
needs nothing but the step. Eval tiles the validation split with windows that do not
overlap (packed alike in 'documents': every held-out token is a target once).
"""
import array
import functools
import io
import json
import os
import weakref
from typing import Any, Iterator, Optional

import ml_collections
import numpy as np

from absl import logging

from zoo.data import dataset, documents, mixture, packing
from zoo.data import tokenizer as tokenizer_lib
from zoo.data.dataset import DataSource, Dataset, padded_rows
from zoo.errors import ConfigError, fail
from zoo.store import storage

FORMAT, VERSION = 'zoo.tokens', 2  # 2 added the document index; 1 reads as 'stream'.
METADATA = dataset.METADATA
SPLITS = ('train', 'val')
WINDOWS = ('documents', 'stream')


def token_dtype(vocab_size: int) -> np.dtype:
  return np.dtype('<u2') if vocab_size <= 2**16 else np.dtype('<u4')


class ShardWriter:
  """Appends tokens to `split-NNNNN.bin` files of at most `shard_tokens` tokens each."""

  def __init__(self, directory: str, split: str, dtype: np.dtype, shard_tokens: int):
    self.directory, self.split, self.dtype = directory, split, np.dtype(dtype)
    self.shard_tokens = shard_tokens
    self.shards: list[dict] = []
    self._file = None

  def write(self, ids: np.ndarray) -> None:
    ids = np.asarray(ids)
    if len(ids) and (ids.min() < 0 or ids.max() > np.iinfo(self.dtype).max):
      raise ConfigError(f'--tokenizer: token id {ids.max()} does not fit {self.dtype.name}; '
                        'the tokenizer\'s vocabulary is inconsistent')
    ids = ids.astype(self.dtype)
    while len(ids):
      if self._file is None or self.shards[-1]['tokens'] == self.shard_tokens:
        self._open_next()
      room = self.shard_tokens - self.shards[-1]['tokens']
      self._file.write(ids[:room].tobytes())
      self.shards[-1]['tokens'] += len(ids[:room])
      ids = ids[room:]

  def _open_next(self):
    if self._file is not None:
      self._file.close()
    name = f'{self.split}-{len(self.shards):05d}.bin'
    self._file = open(os.path.join(self.directory, name), 'wb')
    self.shards.append({'file': name, 'tokens': 0})

  def close(self) -> list[dict]:
    if self._file is not None:
      self._file.close()
      self._file = None
    return self.shards


def read_metadata(path: str, field: str = 'config.data.path') -> dict:
  return dataset.read_metadata(path, FORMAT, (1, VERSION), 'text', field)


def _close_files(readers: list) -> None:
  for reader in readers:
    reader.close()


class TokenSplit:
  """One split's shards as a single token sequence, read window by window; counts what it
  reads.

  Windows are read by byte range (storage.RangeReader): pread on a local disk, one ranged
  GET per window in a bucket, so a process fetches only its own rows. Not through a memory
  map: mapping a file whose pages the kernel caches in large folios maps whole folios, and a
  process reading random windows of a 4 GB dataset grew by ~1.6 MB per window (measured,
  MADV_RANDOM or not).
  """

  def __init__(self, path: str, name: str, meta: dict, field: str = 'config.data.path'):
    dtype = self.dtype = np.dtype(meta['dtype'])
    self.shards, starts = [], [0]  # Open readers, closed when the split is freed.
    weakref.finalize(self, _close_files, self.shards)
    for shard in meta['splits'][name]['shards']:
      file = storage.join(path, shard['file'])
      if not storage.is_file(file):
        raise ConfigError(f'{field}: shard {file} is missing; prepare the dataset again')
      size = storage.size(file)
      if size % dtype.itemsize or size // dtype.itemsize != shard['tokens']:
        raise ConfigError(
            f'{field}: shard {file} is truncated or damaged: {size} bytes, but '
            f'{shard["tokens"]} {dtype.name} tokens ({shard["tokens"] * dtype.itemsize} bytes) '
            'were written; prepare the dataset again')
      self.shards.append(storage.RangeReader(file))
      starts.append(starts[-1] + shard['tokens'])
    self.starts = np.array(starts, np.int64)  # Shard i holds tokens [starts[i], starts[i+1]).
    self.tokens = int(self.starts[-1])
    self.windows_read = 0

  def bytes_read(self) -> int:
    return sum(reader.bytes_read for reader in self.shards)

  def read(self, start: int, length: int) -> np.ndarray:
    """int32 [length]: the tokens at start ... start + length - 1, across shards."""
    out, size = np.empty(length, np.int32), self.dtype.itemsize
    filled, shard = 0, int(np.searchsorted(self.starts, start, side='right')) - 1
    while filled < length:
      offset = int(start + filled - self.starts[shard])
      count = min(length - filled, int(self.starts[shard + 1] - self.starts[shard]) - offset)
      out[filled:filled + count] = np.frombuffer(
          self.shards[shard].read(offset * size, count * size), self.dtype)
      filled += count
      shard += 1
    return out

  def windows(self, positions: np.ndarray, length: int) -> np.ndarray:
    """int32 [n, length]: the tokens at positions[i] ... positions[i] + length - 1."""
    self.windows_read += len(positions)
    return np.stack([self.read(int(p), length) for p in positions]).reshape(-1, length)

  def packed(self, spans: np.ndarray, ends: np.ndarray, seq_len: int, eos: int,
             masks: Optional['TokenSplit'] = None) -> dict:
    """The packed windows whose target ranges are `spans` [n, 2] (see zoo.data.packing);
    `masks`: the split's loss mask (chat data), read for the same targets."""
    self.windows_read += len(spans)
    got = [self.read(max(a - 1, 0), b - max(a - 1, 0)) for a, b in spans.tolist()]
    loss_masks = None if masks is None else [masks.read(a, b - a) for a, b in spans.tolist()]
    return packing.rows(got, spans, ends, seq_len, eos, loss_masks)


class TokenSource:
  """One prepared token dataset (`path`, named in errors by `field`), cut into windows of
  `seq_len` targets as `windows` says: training rows by their position in the source's
  own stream of examples, eval batches, the tokenizer. A mixture (zoo.data.mixture) reads
  several."""

  def __init__(self, path: str, seq_len: int, windows: str, seed: int,
               field: str = 'config.data.path', stream: tuple = (), plan: bool = False):
    """`plan`: for a plan's shapes alone (--dry_run): a split may be shorter than one window
    (packed documents: one window of them, padded, stands for the rest; a stream: the split
    repeated to fill each window)."""
    meta = read_metadata(path, field)
    if windows == 'documents' and meta['version'] < 2:
      raise ConfigError(f'{field}: {path} was prepared without a document index (format '
                        f'version {meta["version"]}); prepare it again with this zoo, or set '
                        "data.windows='stream' to read it as one stream")
    if windows == 'documents' and meta['eos_id'] < 0:
      raise ConfigError(f'{field}: the tokenizer of {path} has no end-of-document token to '
                        "separate documents; set data.windows='stream'")
    self.train, self.val = (TokenSplit(path, name, meta, field) for name in SPLITS)
    self.masks = {}  # Chat data: which targets count (zoo.data.chat), per split.
    if meta.get('loss_mask'):
      if windows != 'documents':
        raise ConfigError(f'{field}: {path} holds conversations with a loss mask; read them as '
                          "documents (data.windows='documents')")
      mask_meta = {'dtype': meta['loss_mask']['dtype'], 'splits': {
          name: {'shards': meta['splits'][name]['mask_shards']} for name in SPLITS}}
      self.masks = {name: TokenSplit(path, name, mask_meta, field) for name in SPLITS}
      for name in SPLITS:
        if self.masks[name].tokens != getattr(self, name).tokens:
          raise ConfigError(f'{field}: the {name} loss mask of {path} does not cover its '
                            'tokens; prepare the dataset again')
    self.chat = meta.get('chat') or {}
    self.path, self.field, self.meta, self.seq_len, self.seed = path, field, meta, seq_len, seed
    self.windows, self.stream, self.eos = windows, stream, meta['eos_id']
    self.vocab_size = meta['vocab_size']
    if windows == 'documents' and self.train.tokens < seq_len and not plan:
      raise ConfigError(f'config.data.seq_len: {seq_len} is longer than the {self.train.tokens} '
                        f'tokens of the train split of {path}; lower data.seq_len or give more '
                        'text')
    for split, name, fix in ((self.train, 'train', 'give it more text'),
                            (self.val, 'validation', 'prepare it with a larger --val_fraction')):
      if windows == 'stream' and split.tokens < seq_len + 1 and not plan:
        raise ConfigError(f'{field}: the {name} split of {path} has {split.tokens} tokens, '
                          f'fewer than data.seq_len + 1 = {seq_len + 1}; lower data.seq_len '
                          f'or {fix}')
    again = 'prepare the dataset again'
    tokenizer_file = storage.join(path, meta['tokenizer']['file'])
    self.tokenizer = tokenizer_lib.load(tokenizer_file, field, again)
    self.tokenizer_json = storage.read_bytes(tokenizer_file)
    bytes_file = storage.join(path, meta['token_bytes'])
    try:
      self.token_bytes = np.load(io.BytesIO(storage.read_bytes(bytes_file)))
    except (OSError, ValueError) as e:
      raise ConfigError(f'{field}: {bytes_file} cannot be read ({type(e).__name__}); '
                        f'{again}') from None
    if self.token_bytes.shape != (self.vocab_size,):
      raise ConfigError(f'{field}: {meta["token_bytes"]} has {self.token_bytes.shape} entries '
                        f'for a vocabulary of {self.vocab_size}; {again}')
    self.plans = {}
    if windows == 'documents':
      for name, split in (('train', self.train), ('val', self.val)):
        ends = self._document_ends(name, split)
        starts = packing.plan(ends, seq_len)
        self.plans[name] = (ends, np.stack([starts[:-1], starts[1:]], 1))
        logging.info('%s%s split: %d documents packed into %d windows of %d tokens, %.2f%% of '
                     'them padding', f'{path}: ' if stream else '', name, len(ends),
                     len(starts) - 1, seq_len, 100 * packing.padding(starts, seq_len))
      self.num_train = len(self.plans['train'][1])
      self._order = packing.EpochOrder(self.num_train, (seed, *stream))
    else:
      self.num_train = self.train.tokens // (seq_len + 1)

  def _document_ends(self, name: str, split: TokenSplit) -> np.ndarray:
    """The split's document index: where each document ends (format version 2)."""
    listed = self.meta['splits'][name].get('documents_file')
    if not isinstance(listed, str) or not listed:
      raise ConfigError(f'{self.field}: {self.path}: metadata.json names no document index for '
                        f'the {name} split; prepare the dataset again')
    file = storage.join(self.path, listed)
    try:
      ends = np.load(io.BytesIO(storage.read_bytes(file)))
    except (OSError, ValueError) as e:
      raise ConfigError(f'{self.field}: {file} cannot be read ({type(e).__name__}); prepare the '
                        'dataset again') from None
    if (ends.ndim != 1 or not len(ends) or ends[-1] != split.tokens
        or np.any(np.diff(ends) < 0) or ends[0] < 0):
      raise ConfigError(f'{self.field}: {file} does not index the {split.tokens} tokens of the '
                        f'{name} split; prepare the dataset again')
    return ends.astype(np.int64)

  def train_rows(self, positions: np.ndarray) -> dict:
    """The training examples at `positions` of this source's endless stream of them: packed
    windows in epochs of permutations; stream windows at a start drawn per position."""
    if self.windows == 'documents':
      ends, spans = self.plans['train']
      return self.train.packed(spans[self._order(positions)], ends, self.seq_len, self.eos,
                               self.masks.get('train'))
    starts = np.array([np.random.default_rng([self.seed, *self.stream, p]).integers(
        0, max(1, self.train.tokens - self.seq_len)) for p in positions.tolist()], np.int64)
    return self._split(self._windows(self.train, starts))

  def train_batch(self, step: int, global_batch_size: int, rows: slice) -> dict:
    """This process's rows of the global batch of `step`: positions step x batch + row
    (packed); stream windows keep their draw from (seed, step)."""
    if self.windows == 'documents':
      return self.train_rows(step * global_batch_size + np.arange(global_batch_size)[rows])
    starts = np.random.default_rng([self.seed, step]).integers(
        0, max(1, self.train.tokens - self.seq_len), size=global_batch_size)[rows]
    return self._split(self._windows(self.train, starts))

  def eval_batches(self, global_batch_size: int, rows: slice) -> Iterator[dict]:
    """The validation split tiled once, with each target's UTF-8 bytes."""
    if self.windows == 'documents':
      ends, spans = self.plans['val']
      batches = ({**self.val.packed(spans[idx], ends, self.seq_len, self.eos,
                                    self.masks.get('val')), 'weights': weights}
                 for idx, weights in padded_rows(len(spans), global_batch_size, rows))
    else:
      window = self.seq_len + 1
      batches = ({**self._split(self._windows(self.val, idx * window)), 'weights': weights}
                 for idx, weights in padded_rows(max(1, self.val.tokens // window),
                                                 global_batch_size, rows))
    for batch in batches:
      yield {**batch, 'bytes': self.token_bytes[batch['targets']]}

  def _windows(self, split: TokenSplit, starts: np.ndarray) -> np.ndarray:
    """Stream windows of seq_len + 1 tokens at `starts`; of a split shorter than one (a
    plan's, for the shapes), the split repeated to fill each."""
    window = self.seq_len + 1
    if split.tokens >= window:
      return split.windows(starts, window)
    whole = split.windows(np.zeros(1, np.int64), split.tokens)[0]
    return np.tile(np.resize(whole, window), (len(starts), 1))

  @staticmethod
  def _split(w: np.ndarray) -> dict:
    return {'inputs': w[:, :-1], 'targets': w[:, 1:]}

  def decode(self, ids: np.ndarray) -> str:
    return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

  def encode(self, text: str) -> np.ndarray:
    return np.array(self.tokenizer.encode(text, add_special_tokens=False).ids, np.int32)


def load(data_config: ml_collections.ConfigDict, seed: int, plan: bool = False) -> Dataset:
  """The prepared tokens (or a mixture of them); a `plan` (--dry_run) compiles for shapes
  alone, so splits shorter than one window are taken (TokenSource)."""
  windows = data_config.get('windows', 'documents')
  if data_config.get('sources'):
    return mixture.load(data_config, seed, functools.partial(
        TokenSource, seq_len=data_config.seq_len, windows=windows, seed=seed, plan=plan))
  source = TokenSource(data_config.path, data_config.seq_len, windows, seed, plan=plan)
  return Dataset(task='lm', model_fields={'vocab_size': source.vocab_size},
                 train_batch=source.train_batch, eval_batches=source.eval_batches,
                 num_train=source.num_train, decode=source.decode, encode=source.encode,
                 token_unit='token', examples_read=lambda: source.train.windows_read,
                 eos_id=source.eos if source.eos >= 0 else None,
                 sample_prompt=source.chat.get('sample_prompt'),
                 stop_ids=tuple(source.chat.get('stop_ids', ())))


def tokenizer_dataset(path: str, vocab_size: int, seq_len: int) -> Dataset:
  """A language 'dataset' with a tokenizer and no text: what an imported model without
  training data is sampled through (its shapes; encode and decode)."""
  tokenizer = tokenizer_lib.load(path, 'tokenizer.json', 'give the tokenizer.json the model '
                                 'was imported with')

  def train_batch(step, global_batch_size, rows):
    del step
    size = len(range(global_batch_size)[rows])
    return {'inputs': np.zeros((size, seq_len), np.int32),
            'targets': np.zeros((size, seq_len), np.int32)}

  eos = tokenizer_lib.eos_id(tokenizer)
  return Dataset(task='lm', model_fields={'vocab_size': vocab_size}, train_batch=train_batch,
                 eval_batches=lambda global_batch_size, rows: iter(()), num_train=0,
                 eos_id=eos if eos >= 0 else None,
                 decode=lambda ids: tokenizer.decode([int(i) for i in ids],
                                                     skip_special_tokens=False),
                 encode=lambda text: np.array(tokenizer.encode(text, add_special_tokens=False).ids,
                                              np.int32),
                 token_unit='token')


def check_config(data_config: ml_collections.ConfigDict) -> None:
  if data_config.get('windows', 'documents') not in WINDOWS:
    fail('data.windows', f'unknown windows {data_config.windows!r}; known: {", ".join(WINDOWS)}')
  if data_config.get('sources'):
    for name, path in mixture.check_config(data_config).items():
      read_metadata(path, f'config.data.sources.{name}')
    return
  if not data_config.get('path'):
    fail('data.path', 'is empty; give the directory that `python -m zoo.prepare text` wrote')
  read_metadata(data_config.path)


SOURCE = DataSource(load, task='lm', check_config=check_config,
                    plan_load=functools.partial(load, plan=True))


def describe(meta: dict) -> str:
  """One line per split: tokens, documents, bytes per token."""
  lines = []
  for name in SPLITS:
    split = meta['splits'][name]
    per_token = split['bytes'] / max(split['tokens'], 1)
    lines.append(f'{name}: {split["tokens"]:,} tokens in {len(split["shards"])} shards, '
                 f'{split["documents"]:,} documents, {split["bytes"]:,} bytes '
                 f'({per_token:.2f} bytes per token)')
  return '\n'.join(lines)


def _hash(index: int, seed: int) -> float:
  """A fixed hash of (seed, index) in [0, 1): splitmix64."""
  x = (index + (seed + 1) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
  x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
  x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
  return (x ^ (x >> 31)) / 2.0**64


def in_validation(index: int, val_fraction: float, seed: int = 0, forced: int = -1) -> bool:
  """Whether document `index` belongs to the validation split: a fixed hash of (seed,
  index) below val_fraction, so the split does not depend on how documents are batched;
  and document `forced` (see first_in_validation)."""
  return index == forced or _hash(index, seed) < val_fraction


def first_in_validation(count: int, seed: int = 0) -> int:
  """The document of `count` that a split too small for any goes to: the one whose hash is
  lowest, the first a larger val_fraction would take (the split rounds up to one document,
  as scikit-learn's train_test_split does)."""
  return min(range(count), key=lambda i: _hash(i, seed))


class EmptyValSplit(Exception):
  """No document hashed into the validation split; `documents`: how many there are."""

  def __init__(self, documents: int):
    super().__init__(documents)
    self.documents = documents


def split_documents(files, field, column, val_fraction, seed, want,
                    forced: int = -1) -> Iterator[str]:
  """The documents of one split ('train' or 'val'), in input order (e.g. to train a BPE)."""
  index = 0
  for path in files:
    for text in documents.read(path, field, column):
      if (want == 'val') == in_validation(index, val_fraction, seed, forced):
        yield text
      index += 1


def make_tokenizer(spec: str, vocab_size: int, train_documents: Iterator[str]) -> Any:
  """'bytes', 'bpe' (trained on `train_documents`), a tokenizer.json, or the directory of a
  model or zoo run that has one (tokenizer.resolve)."""
  if spec == 'bytes':
    return tokenizer_lib.bytes_tokenizer()
  if spec == 'bpe':
    return tokenizer_lib.train_bpe(train_documents, vocab_size)
  return tokenizer_lib.load(tokenizer_lib.resolve(spec))


def prepare(files: list[str], directory: str, tokenizer: Any, *, field: str = 'text',
            column: str = 'text', val_fraction: float = 0.01, seed: int = 0, forced: int = -1,
            shard_tokens: int = 2**28, progress: Any = None, chunk_bytes: int = 2**22) -> dict:
  """Tokenizes the documents of `files` into `directory` (existing, empty); returns the
  metadata it wrote last. Documents are encoded in chunks of about `chunk_bytes`, each in
  parallel over the cores; `progress.update(bytes)` follows the input. Raises EmptyValSplit
  if no document went to the validation split and `forced` did not name one (the caller
  starts again with `forced=first_in_validation(...)`)."""
  vocab_size = tokenizer_lib.vocab_size(tokenizer)
  dtype, eos = token_dtype(vocab_size), tokenizer_lib.eos_id(tokenizer)
  writers = {name: ShardWriter(directory, name, dtype, shard_tokens) for name in SPLITS}
  counts = {name: {'tokens': 0, 'documents': 0, 'bytes': 0} for name in SPLITS}
  chunk, size, index = {name: [] for name in SPLITS}, 0, 0
  ends = {name: array.array('q') for name in SPLITS}  # Where each document ends.

  def flush():
    for name, texts in chunk.items():
      for ids in tokenizer_lib.encode_documents(tokenizer, texts, eos):
        writers[name].write(ids)
        counts[name]['tokens'] += len(ids)
        ends[name].append(counts[name]['tokens'])
      texts.clear()

  for path in files:
    for text in documents.read(path, field, column):
      name = 'val' if in_validation(index, val_fraction, seed, forced) else 'train'
      nbytes = len(text.encode('utf-8'))
      chunk[name].append(text)
      counts[name]['documents'] += 1
      counts[name]['bytes'] += nbytes
      index, size = index + 1, size + nbytes
      if progress is not None:
        progress.update(nbytes)
        progress.set_postfix_str(f'{index:,} documents', refresh=False)
      if size >= chunk_bytes:
        flush()
        size = 0
  flush()
  if not counts['val']['documents'] and forced < 0 and index > 1:
    for writer in writers.values():
      writer.close()
    raise EmptyValSplit(index)
  for name, fix in (('train', 'give more documents'),
                    ('val', 'raise --val_fraction or give more documents')):
    if not counts[name]['documents'] or not counts[name]['tokens']:
      raise ConfigError(f'--input: the {name} split is empty ({index} documents in all, '
                        f'--val_fraction={val_fraction}); {fix}')
  tokenizer.save(os.path.join(directory, 'tokenizer.json'))
  np.save(os.path.join(directory, 'token_bytes.npy'), tokenizer_lib.token_bytes(tokenizer))
  for name in SPLITS:
    np.save(os.path.join(directory, f'{name}-documents.npy'), np.frombuffer(ends[name], np.int64))
  meta = {'format': FORMAT, 'version': VERSION, 'vocab_size': vocab_size, 'dtype': dtype.str,
          'eos_id': eos, 'tokenizer': {'file': 'tokenizer.json'}, 'token_bytes': 'token_bytes.npy',
          'val_fraction': val_fraction, 'seed': seed, 'inputs': files,
          **({'val_forced': forced} if forced >= 0 else {}),
          'splits': {name: {**counts[name], 'shards': writers[name].close(),
                            'documents_file': f'{name}-documents.npy'} for name in SPLITS}}
  with open(os.path.join(directory, METADATA), 'w', encoding='utf-8') as f:
    json.dump(meta, f, indent=2)
  return meta
