"""Weighted mixtures of prepared datasets (`data.sources` and `data.weights`):

    c.data.sources = {'code': 'data/stdlib_bpe', 'docs': 'data/pydoc_bpe'}
    c.data.weights = {'code': 0.7, 'docs': 0.3}
    # Or lists, in order; a source is named by its path's last part:
    c.data.sources = ('data/stdlib_bpe', 'data/pydoc_bpe')
    c.data.weights = (0.7, 0.3)

The global stream of training examples (position p = step x batch size + row) is cut into
blocks of BLOCK positions; each block holds each source's share of them exactly (largest
remainders), in an order drawn from (seed, block), as Levanter's mixtures draw theirs. A
position's source, and its index in that source's own stream of examples, follow from
(seed, p) alone: batches are exact on resume and on any number of processes, and a
process reads only the sources its rows come from. A source of weight 0 is held out:
evaluated, never trained on. Eval reports each source on its own (`eval/<name>/loss`,
`eval/<name>/bits_per_byte`, ...) and all of them together (`eval/loss`, ...). Sources
must share a tokenizer (prepare the others with `--tokenizer=<first>/tokenizer.json`).
"""
import math
from typing import Any, Callable

from absl import logging
import ml_collections
import numpy as np

from zoo.data.dataset import Dataset
from zoo.errors import ConfigError, fail

BLOCK = 4096  # Positions per block: each source's share is exact within every block.
_MIX = 0x6D6978  # Keeps the blocks' draws apart from the sources' own (seed, ...) draws.


def check_config(data_config: ml_collections.ConfigDict) -> dict[str, str]:
  """The sources, name -> path; fails naming data.sources, data.weights or data.path."""
  if data_config.get('path'):
    fail('data.path', f'{data_config.path!r} and data.sources are both set; give one: a '
         'single dataset or a mixture')
  sources = named_sources(data_config)
  weights(data_config)
  return sources


def named_sources(data_config: ml_collections.ConfigDict) -> dict[str, str]:
  """data.sources as name -> path: a dict as given (a ConfigDict lists its keys sorted), or
  a list of paths named by their last part, in order."""
  given = data_config.sources
  if hasattr(given, 'items'):
    sources = dict(given.items())
  elif isinstance(given, (list, tuple)):
    sources = {}
    for path in given:
      name = str(path).rstrip('/').rsplit('/', 1)[-1]
      if name in sources:
        fail('data.sources', f'two sources are named {name!r} (the last part of their paths); '
             "give a dict of name -> path, e.g. {'web': 'data/web', 'code': 'data/code'}")
      sources[name] = path
  else:
    sources = None
  if not sources:
    fail('data.sources', f'must map names to prepared dataset directories, e.g. '
         f"{{'web': 'data/web', 'code': 'data/code'}}, or list them; got {given!r}")
  for name, path in sources.items():
    if not isinstance(path, str) or not path:
      fail(f'data.sources.{name}', f'must be a prepared dataset directory, got {path!r}')
  return sources


def weights(data_config: ml_collections.ConfigDict) -> dict[str, float]:
  """data.weights normalised to sum to 1, by source name, in the order of the sources."""
  names, given = list(named_sources(data_config)), data_config.get('weights')
  if not given:
    fail('data.weights', f'is empty; give one weight per source of data.sources '
         f'({", ".join(names)}), e.g. a dict of name -> weight')
  if hasattr(given, 'items'):
    for name in sorted(set(given) - set(names)):
      fail(f'data.weights.{name}', f'names no source; the sources are {", ".join(names)}')
    for name in names:
      if name not in given:
        fail('data.weights', f'has no weight for source {name!r}; give one (0: evaluated only)')
    values = [given[name] for name in names]
  elif hasattr(data_config.sources, 'items'):
    fail('data.weights', 'is a list, but data.sources is a dict, which keeps no order; give a '
         'dict of name -> weight')
  else:
    values = list(given)
    if len(values) != len(names):
      fail('data.weights', f'has {len(values)} weights for the {len(names)} sources '
           f'({", ".join(names)}); give one each, in that order')
  for name, value in zip(names, values):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
        math.isfinite(value) and value >= 0):
      fail('data.weights', f'the weight of {name!r} must be a finite number >= 0, got {value!r}')
  total = float(sum(values))
  if total <= 0:
    fail('data.weights', 'are all 0; give at least one source a positive weight')
  return {name: value / total for name, value in zip(names, values)}


def shares(weights_: list[float], block: int = BLOCK) -> np.ndarray:
  """Each source's positions in a block: largest remainders of weight x block."""
  exact = np.asarray(weights_, np.float64) * block
  counts = np.floor(exact).astype(np.int64)
  for j in np.argsort(-(exact - counts), kind='stable')[:block - counts.sum()]:
    counts[j] += 1
  return counts


class Assignment:
  """Position of the global example stream -> (source, index in the source's stream)."""

  def __init__(self, weights_: list[float], seed: int, block: int = BLOCK):
    self.counts, self.seed, self.block, self._cache = shares(weights_, block), seed, block, {}

  def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
    if b not in self._cache:
      if len(self._cache) > 1:
        self._cache.pop(min(self._cache))
      source = np.random.default_rng([self.seed, _MIX, b]).permutation(
          np.repeat(np.arange(len(self.counts)), self.counts))
      rank = np.empty(self.block, np.int64)  # How many of its source come before it.
      for j in range(len(self.counts)):
        where = np.flatnonzero(source == j)
        rank[where] = np.arange(len(where))
      self._cache[b] = (source, rank)
    return self._cache[b]

  def __call__(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    blocks, within = np.divmod(np.asarray(positions, np.int64), self.block)
    source, local = np.empty(len(blocks), np.int64), np.empty(len(blocks), np.int64)
    for b in np.unique(blocks).tolist():
      here = blocks == b
      block_source, rank = self._block(b)
      source[here] = block_source[within[here]]
      local[here] = b * self.counts[source[here]] + rank[within[here]]
    return source, local


def load(data_config: ml_collections.ConfigDict, seed: int,
         open_source: Callable[..., Any]) -> Dataset:
  """The mixture of data.sources, each opened by `open_source(path, field=, stream=)` (e.g.
  zoo.data.tokens.TokenSource): an object with `train_rows(positions)`,
  `eval_batches(batch size, rows)`, `num_train`, `vocab_size`, `tokenizer_json`,
  `decode`, `encode` and `train.windows_read`."""
  shares_, paths = weights(data_config), named_sources(data_config)
  names = list(shares_)
  sources = [open_source(paths[name], field=f'config.data.sources.{name}', stream=(j + 1,))
             for j, name in enumerate(names)]
  first = sources[0]
  for name, source in zip(names[1:], sources[1:]):
    if source.tokenizer_json != first.tokenizer_json:
      raise ConfigError(f'config.data.sources.{name}: {source.path} was prepared with another '
                        f'tokenizer than {names[0]!r}; prepare it again with '
                        f'--tokenizer={first.path}/tokenizer.json')
  assign = Assignment([shares_[n] for n in names], seed)
  logging.info('mixture: %s', ', '.join(
      f'{n} {shares_[n]:.1%} ({s.num_train:,} training examples)' for n, s in zip(names, sources)))

  def train_batch(step, global_batch_size, rows):
    source, local = assign(step * global_batch_size + np.arange(global_batch_size)[rows])
    batch = {}
    for j in np.unique(source).tolist():
      here = source == j
      part = sources[j].train_rows(local[here])
      for key, value in part.items():
        if key not in batch:
          batch[key] = np.zeros((len(source),) + value.shape[1:], value.dtype)
        batch[key][here] = value
    return batch

  def eval_batches(global_batch_size, rows):
    for source in sources:
      yield from source.eval_batches(global_batch_size, rows)

  return Dataset(
      task='lm', model_fields={'vocab_size': first.vocab_size}, train_batch=train_batch,
      eval_batches=eval_batches, num_train=sum(s.num_train for n, s in zip(names, sources)
                                                if shares_[n] > 0),
      decode=first.decode, encode=first.encode, token_unit='token',
      examples_read=lambda: sum(s.train.windows_read for s in sources),
      eval_sources={n: s.eval_batches for n, s in zip(names, sources)},
      eos_id=first.eos if first.eos >= 0 else None)
