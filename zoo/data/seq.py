"""Generated sequence-to-sequence problems with a known answer, for the encoder-decoder.

`data.problem` (digits n = `data.digits`):
- 'add':     source "a+b" (two n-digit numbers, zero-padded, most significant digit first),
             target a+b in n+1 digits, least significant first: the order of written
             addition, in which each digit's carry follows from the previous digits (most
             significant first, a decoder must resolve every carry before its first digit);
- 'reverse': source n digits, target the same digits reversed;
- 'sort':    source n digits, target the same digits in ascending order.

Tokens: 0-9 are digits, 10 is '+', 11 starts the decoder input (BOS). Training examples
are drawn fresh per step from (seed, step), without end. The held-out set is fixed, and
disjoint from training: a source whose hash is 0 mod 97 is an eval example, and the
training stream redraws such sources.
"""
import ml_collections
import numpy as np

from zoo.data.dataset import DataSource, Dataset, padded_batches
from zoo.errors import ConfigError, fail

PLUS, BOS = 10, 11
VOCAB = '0123456789+^'
PROBLEMS = ('add', 'reverse', 'sort')
_HELD_OUT_MOD = 97


def _digits_of(numbers, width):
  """int64 [N] -> digits [N, width], most significant first."""
  powers = 10 ** np.arange(width - 1, -1, -1, dtype=np.int64)
  return (numbers[:, None] // powers) % 10


def _examples(problem, n, rng, size):
  """(sources [size, M], targets [size, L]) as int32."""
  if problem == 'add':
    a, b = (rng.integers(0, 10 ** n, size=size, dtype=np.int64) for _ in range(2))
    source = np.concatenate([_digits_of(a, n), np.full((size, 1), PLUS), _digits_of(b, n)], 1)
    target = _digits_of(a + b, n + 1)[:, ::-1]
  else:
    source = rng.integers(0, 10, size=(size, n))
    target = source[:, ::-1] if problem == 'reverse' else np.sort(source, axis=1)
  return source.astype(np.int32), target.astype(np.int32)


def _held_out(sources):
  """Which sources belong to the eval split: a polynomial hash of the tokens, mod 97."""
  weights = np.array([pow(13, i, _HELD_OUT_MOD) for i in range(sources.shape[1])], np.int64)
  return (sources.astype(np.int64) @ weights) % _HELD_OUT_MOD == 0


def _held_out_set(problem, n, num_eval, seed, rounds=100):
  """`num_eval` distinct held-out (source, target) pairs, the same for every process.

  Few digits have few held-out sources (3 digits: 11 of 1,000); asking for more fails.
  """
  rng, found = np.random.default_rng([seed, 2**32 - 1]), {}
  for _ in range(rounds):
    source, target = _examples(problem, n, rng, 100 * _HELD_OUT_MOD)
    mask = _held_out(source)
    for s, t in zip(source[mask], target[mask]):
      found.setdefault(s.tobytes(), (s, t))
    if len(found) >= num_eval:
      pairs = list(found.values())[:num_eval]
      return np.stack([s for s, _ in pairs]), np.stack([t for _, t in pairs])
  raise ConfigError(f'config.data.num_eval: {num_eval} exceeds the {len(found)} distinct held-out '
                    f'{problem!r} examples found with data.digits={n}; lower data.num_eval or '
                    'raise data.digits')


def _batch(source, target):
  bos = np.full((len(target), 1), BOS, np.int32)
  return {'inputs': source, 'decoder_inputs': np.concatenate([bos, target[:, :-1]], 1),
          'targets': target}


def load(data_config: ml_collections.ConfigDict, seed: int) -> Dataset:
  problem, n, num_eval = data_config.problem, data_config.digits, data_config.num_eval

  def train_batch(step, global_batch_size, rows):
    rng = np.random.default_rng([seed, step])
    source, target = _examples(problem, n, rng, global_batch_size)
    redraw = _held_out(source)
    while redraw.any():  # ~1% of draws; each round redraws only those rows.
      source[redraw], target[redraw] = _examples(problem, n, rng, int(redraw.sum()))
      redraw = _held_out(source)
    return {k: v[rows] for k, v in _batch(source, target).items()}

  eval_set = _batch(*_held_out_set(problem, n, num_eval, seed))

  def eval_batches(global_batch_size, rows):
    return padded_batches(eval_set, global_batch_size, rows)

  def decode(ids):
    return ''.join(VOCAB[i] for i in np.clip(ids, 0, len(VOCAB) - 1))

  return Dataset(task='seq2seq', model_fields={'vocab_size': len(VOCAB)},
                 train_batch=train_batch, eval_batches=eval_batches, num_train=2**62,
                 decode=decode)


def check_config(data_config: ml_collections.ConfigDict) -> None:
  if data_config.get('problem') not in PROBLEMS:
    fail('data.problem', f'unknown problem {data_config.get("problem")!r}; '
         f'known: {", ".join(PROBLEMS)}')
  if not 1 <= data_config.get('digits', 0) <= 18:
    fail('data.digits', f'must be in 1..18 (int64 sums), got {data_config.get("digits")}')
  if data_config.get('num_eval', 0) <= 0:
    fail('data.num_eval', f'must be positive, got {data_config.get("num_eval")}')


SOURCE = DataSource(load, task='seq2seq', check_config=check_config)
