"""Character-level text: a user's UTF-8 file, or English prose bundled with Python.

With `data.path` empty, the corpus is `pydoc_data.topics` (~465k characters of the
Python language reference that every CPython ships), so nothing is downloaded.
The first 90% of the characters train, the last 10% evaluate.
"""
import numpy as np

from zoo.data import Dataset, padded_batches
from zoo.errors import ConfigError

EVAL_FRACTION = 0.1


def bundled_corpus():
  from pydoc_data import topics  # pylint: disable=import-outside-toplevel
  return '\n\n'.join(topics.topics[k] for k in sorted(topics.topics))


def load(data_config, seed):
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
  split = int(len(tokens) * (1 - EVAL_FRACTION))
  train, held_out = tokens[:split], tokens[split:]
  window = data_config.seq_len + 1
  if len(held_out) < window:
    raise ConfigError(f'config.data.path: its last {EVAL_FRACTION:.0%} (the eval split) is shorter '
                      f'than data.seq_len + 1 = {window} characters; give a longer text')

  def train_batch(step, global_batch_size, rows):
    starts = np.random.default_rng([seed, step]).integers(
        0, len(train) - window + 1, size=global_batch_size)[rows]
    w = train[starts[:, None] + np.arange(window)]
    return {'inputs': w[:, :-1], 'targets': w[:, 1:]}

  def eval_batches(global_batch_size, rows):
    n = len(held_out) // window
    w = held_out[:n * window].reshape(n, window)
    return padded_batches({'inputs': w[:, :-1], 'targets': w[:, 1:]}, global_batch_size, rows)

  return Dataset(model_fields={'vocab_size': len(chars)},
                 train_batch=train_batch, eval_batches=eval_batches,
                 num_train=len(train) // window, decode=decode, encode=encode)
