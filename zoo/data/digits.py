"""The 1,797 8x8 handwritten digits that ship with scikit-learn (UCI optdigits test set).

Split once with a fixed seed, independent of the run's seed: 1,437 train, 360 test.
"""
import importlib.util
import os

import ml_collections
import numpy as np

from zoo.data.dataset import DataSource, Dataset, arrays_dataset

SPLIT_SEED = 0
NUM_TEST = 360


def _digits() -> tuple[np.ndarray, np.ndarray]:
  """scikit-learn's digits: images [1797, 8, 8] of 0..16 (float64) and their labels. Read
  from the file it ships, as its load_digits reads it, without importing scikit-learn (1.1 s
  of every run's start-up on a 2-core CPU); through load_digits where that file is not."""
  spec = importlib.util.find_spec('sklearn')  # Finds the package without running it.
  path = os.path.join(os.path.dirname(spec.origin), 'datasets', 'data', 'digits.csv.gz') if (
      spec and spec.origin) else ''
  if not os.path.isfile(path):
    from sklearn.datasets import load_digits  # pylint: disable=import-outside-toplevel
    digits = load_digits()
    return digits.images, digits.target
  table = np.loadtxt(path, delimiter=',')
  return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(int)


def load(data_config: ml_collections.ConfigDict, seed: int) -> Dataset:
  del data_config  # No options: the data ships with scikit-learn.
  images, target = _digits()
  x = (images / 16.0).astype(np.float32)[..., None]  # [N, 8, 8, 1] in [0, 1].
  y = target.astype(np.int32)
  perm = np.random.default_rng(SPLIT_SEED).permutation(len(y))
  train, test = perm[NUM_TEST:], perm[:NUM_TEST]
  return arrays_dataset(x[train], y[train], x[test], y[test], seed, num_classes=10)


def write_image_folder(root: str) -> None:
  """The digits as 8x8 grayscale PNGs in an image-folder tree, ROOT/{train,val}/<digit>/,
  split as `load` splits them (for `python -m zoo.prepare images`)."""
  from PIL import Image  # pylint: disable=import-outside-toplevel
  images, target = _digits()
  pixels = np.round(images * (255 / 16)).astype(np.uint8)
  perm = np.random.default_rng(SPLIT_SEED).permutation(len(pixels))
  for split, indices in (('train', perm[NUM_TEST:]), ('val', perm[:NUM_TEST])):
    for i in indices:
      folder = os.path.join(root, split, str(target[i]))
      os.makedirs(folder, exist_ok=True)
      Image.fromarray(pixels[i], mode='L').save(os.path.join(folder, f'{i:04d}.png'))


SOURCE = DataSource(load, task='classification')
