"""The 1,797 8x8 handwritten digits that ship with scikit-learn (UCI optdigits test set).

Split once with a fixed seed, independent of the run's seed: 1,437 train, 360 test.
"""
import os

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


def write_image_folder(root: str) -> None:
  """The digits as 8x8 grayscale PNGs in an image-folder tree, ROOT/{train,val}/<digit>/,
  split as `load` splits them (for `python -m zoo.prepare images`)."""
  from PIL import Image  # pylint: disable=import-outside-toplevel
  from sklearn.datasets import load_digits  # pylint: disable=import-outside-toplevel
  digits = load_digits()
  pixels = np.round(digits.images * (255 / 16)).astype(np.uint8)
  perm = np.random.default_rng(SPLIT_SEED).permutation(len(pixels))
  for split, indices in (('train', perm[NUM_TEST:]), ('val', perm[:NUM_TEST])):
    for i in indices:
      folder = os.path.join(root, split, str(digits.target[i]))
      os.makedirs(folder, exist_ok=True)
      Image.fromarray(pixels[i], mode='L').save(os.path.join(folder, f'{i:04d}.png'))


SOURCE = DataSource(load, task='classification')
