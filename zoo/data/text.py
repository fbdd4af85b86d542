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
  if len(tokens) - split < data_config.seq_len + 1:
    raise ConfigError(f'config.data.path: its last {EVAL_FRACTION:.0%} (the eval split) is shorter '
                      f'than data.seq_len + 1 = {data_config.seq_len + 1} characters; give a longer text')
  return token_windows(tokens[:split], tokens[split:], data_config.seq_len, seed, len(chars),
                       decode=decode, encode=encode)


def token_windows(train, held_out, seq_len, seed, vocab_size, decode, encode=None):
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
