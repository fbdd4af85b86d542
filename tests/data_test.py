"""Batches are a pure function of (seed, step); eval covers every example exactly once."""
import ml_collections
import numpy as np
import pytest

from zoo import data
from zoo.data import dataset


def _load(name):
  c = ml_collections.ConfigDict({'name': name, 'path': '', 'seq_len': 16})
  return data.load(c, seed=3)


@pytest.mark.parametrize('name', ['digits', 'text'])
def test_train_batch_is_a_function_of_seed_and_step(name):
  a, b = _load(name), _load(name)
  for step in (0, 1, 57):
    x, y = a.train_batch(step, 32, slice(None)), b.train_batch(step, 32, slice(None))
    np.testing.assert_array_equal(x['inputs'], y['inputs'])
  assert not np.array_equal(a.train_batch(0, 32, slice(None))['inputs'],
                            a.train_batch(1, 32, slice(None))['inputs'])


@pytest.mark.parametrize('name', ['digits', 'text'])
def test_row_slices_concatenate_to_the_global_batch(name):
  ds = _load(name)
  full = ds.train_batch(5, 32, slice(None))
  halves = [ds.train_batch(5, 32, slice(0, 16)), ds.train_batch(5, 32, slice(16, 32))]
  for key in full:
    np.testing.assert_array_equal(np.concatenate([h[key] for h in halves]), full[key])


def test_epochs_visit_every_example_once():
  n, batch = 1437, 128
  seen = np.concatenate([dataset.epoch_order(0, n, step, batch) for step in range(n // batch)])
  assert len(np.unique(seen)) == len(seen) == (n // batch) * batch
  next_epoch = dataset.epoch_order(0, n, n // batch, batch)
  assert not np.array_equal(next_epoch, seen[:batch])


def test_eval_batches_pad_and_count_each_example_once():
  x = np.arange(10)
  batches = list(dataset.padded_batches({'inputs': x}, 4, slice(None)))
  assert len(batches) == 3
  weights = np.concatenate([b['weights'] for b in batches])
  inputs = np.concatenate([b['inputs'] for b in batches])
  np.testing.assert_array_equal(weights, [1] * 10 + [0, 0])
  np.testing.assert_array_equal(inputs[:10], x)


def test_text_targets_are_inputs_shifted_by_one():
  batch = _load('text').train_batch(0, 4, slice(None))
  np.testing.assert_array_equal(batch['inputs'][:, 1:], batch['targets'][:, :-1])
  assert batch['inputs'].shape == (4, 16)


def test_digits_are_scikit_learns_read_without_importing_it(monkeypatch):
  """The digits file scikit-learn ships, read as its load_digits reads it, equals
  load_digits (also where the file is missing and load_digits reads it), and a run's
  process loading them imports no scikit-learn (a second of start-up)."""
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  from sklearn.datasets import load_digits  # pylint: disable=import-outside-toplevel
  from zoo.data import digits  # pylint: disable=import-outside-toplevel
  want = load_digits()
  for found in (True, False):
    if not found:
      monkeypatch.setattr(digits.importlib.util, 'find_spec', lambda name: None)
    images, target = digits._digits()  # pylint: disable=protected-access
    np.testing.assert_array_equal(images, want.images)
    np.testing.assert_array_equal(target, want.target)
  probe = ('import sys; from zoo.data import digits; digits.load(None, 0); '
           'print("sklearn" in sys.modules)')
  assert subprocess.run([sys.executable, '-c', probe], capture_output=True, text=True,
                        check=True, timeout=60).stdout.strip() == 'False'
