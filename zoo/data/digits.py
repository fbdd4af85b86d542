"""The 1,797 8x8 handwritten digits that ship with scikit-learn (UCI optdigits test set).

Split once with a fixed seed, independent of the run's seed: 1,437 train, 360 test.
"""
import ml_collections
import numpy as np

from zoo.data.dataset import DataSource, Dataset, arrays_dataset

SPLIT_SEED = 0
NUM_TEST = 360


def load(data_config: ml_collections.ConfigDict, seed: int) -> Dataset:
  del data_config  # No options: the data ships with scikit-learn.
  from sklearn.datasets import load_digits  # pylint: disable=import-outside-toplevel
  digits = load_digits()
  x = (digits.images / 16.0).astype(np.float32)[..., None]  # [N, 8, 8, 1] in [0, 1].
  y = digits.target.astype(np.int32)
  perm = np.random.default_rng(SPLIT_SEED).permutation(len(y))
  train, test = perm[NUM_TEST:], perm[:NUM_TEST]
  return arrays_dataset(x[train], y[train], x[test], y[test], seed, num_classes=10)


SOURCE = DataSource(load, task='classification')
