"""The 1,797 8x8 handwritten digits that ship with scikit-learn (UCI optdigits test set).

Split once with a fixed seed, independent of the run's seed: 1,437 train, 360 test.
"""
import numpy as np

from zoo.data import Dataset, epoch_order, padded_batches

SPLIT_SEED = 0
NUM_TEST = 360


def load(data_config, seed):
  del data_config  # No options: the data ships with scikit-learn.
  from sklearn.datasets import load_digits  # pylint: disable=import-outside-toplevel
  digits = load_digits()
  x = (digits.images / 16.0).astype(np.float32)[..., None]  # [N, 8, 8, 1] in [0, 1].
  y = digits.target.astype(np.int32)
  perm = np.random.default_rng(SPLIT_SEED).permutation(len(y))
  train, test = perm[NUM_TEST:], perm[:NUM_TEST]
  return arrays_dataset(x[train], y[train], x[test], y[test], seed, num_classes=10)


def arrays_dataset(x_train, y_train, x_test, y_test, seed, num_classes):
  """A classification Dataset over in-memory arrays: a fresh permutation per epoch."""
  def train_batch(step, global_batch_size, rows):
    idx = epoch_order(seed, len(y_train), step, global_batch_size)[rows]
    return {'inputs': x_train[idx], 'targets': y_train[idx]}

  def eval_batches(global_batch_size, rows):
    return padded_batches({'inputs': x_test, 'targets': y_test}, global_batch_size, rows)

  return Dataset(task='classification', model_fields={'num_classes': num_classes},
                 train_batch=train_batch, eval_batches=eval_batches, num_train=len(y_train))
