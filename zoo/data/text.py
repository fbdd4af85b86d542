"""Character-level text: a user's UTF-8 file, or English prose bundled with Python.

With `data.path` empty, the corpus is `pydoc_data.topics` (~465k characters of the
Python language reference that every CPython ships), so nothing is downloaded.
The first 90% of the characters train, the last 10% evaluate.
"""
import functools
import os

import ml_collections
import numpy as np

from zoo.data.dataset import DataSource, Dataset, token_windows
from zoo.errors import ConfigError, fail

EVAL_FRACTION = 0.1


def bundled_corpus() -> str:
  from pydoc_data import topics  # pylint: disable=import-outside-toplevel
  return '\n\n'.join(topics.topics[k] for k in sorted(topics.topics))


def load(data_config: ml_collections.ConfigDict, seed: int, plan: bool = False) -> Dataset:
  """The text's windows of data.seq_len characters. A `plan` compiles for shapes alone: a
  text whose eval split holds no window is repeated until it does."""
  if data_config.path:
    with open(data_config.path, encoding='utf-8') as f:
      corpus = f.read()
  else:
    corpus = bundled_corpus()
  chars = sorted(set(corpus))
  index = {c: i for i, c in enumerate(chars)}
  table = np.array(chars)

  def encode(text):
    return np.array([index.get(c, 0) for c in text], dtype=np.int32)

  def decode(ids):
    return ''.join(table[np.clip(ids, 0, len(chars) - 1)])

  tokens = encode(corpus)
  if plan:
    tokens = np.tile(tokens, -(-(data_config.seq_len + 1) // max(1, int(len(tokens) * EVAL_FRACTION))) + 1)
  split = int(len(tokens) * (1 - EVAL_FRACTION))
  if len(tokens) - split < data_config.seq_len + 1:
    raise ConfigError(f'config.data.path: its last {EVAL_FRACTION:.0%} (the eval split) is '
                      f'shorter than data.seq_len + 1 = {data_config.seq_len + 1} characters; give '
                      'a longer text')
  return token_windows(tokens[:split], tokens[split:], data_config.seq_len, seed, len(chars),
                       decode=decode, encode=encode)


def check_config(data_config: ml_collections.ConfigDict) -> None:
  if data_config.path and not os.path.isfile(data_config.path):
    fail('data.path', f'{data_config.path} is not a file; give a UTF-8 text file, or leave it '
         'empty for the text bundled with Python')


SOURCE = DataSource(load, task='lm', check_config=check_config,
                    plan_load=functools.partial(load, plan=True))
