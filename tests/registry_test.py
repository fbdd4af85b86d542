"""A model family and a dataset defined in this file alone, registered with one line each,
train on a mesh through the unchanged trainer; their own checks reach the user."""
import json
import os
import re
import types

import flax.linen as nn
import jax
import numpy as np
import pytest

from conftest import read_metrics
from zoo import data, models
from zoo.data.dataset import DataSource, arrays_dataset
from zoo.errors import ConfigError, fail
from zoo.models import layers
from zoo.models.family import ModelFamily
from zoo.run import config as cfg
from zoo.run import train


class Toy(nn.Module):
  """A one-hidden-layer classifier speaking only logical axis names."""
  hidden: int
  num_classes: int

  @nn.compact
  def __call__(self, x, train=False):
    del train
    x_BF = nn.with_logical_constraint(x.reshape(x.shape[0], -1), ('act_batch', 'act_embed'))
    h_BH = nn.relu(layers.dense(self.hidden, ('embed', 'mlp'), 'hidden')(x_BF))
    h_BH = nn.with_logical_constraint(h_BH, ('act_batch', 'act_mlp'))
    return layers.dense(self.num_classes, ('mlp', 'classes'), 'head')(h_BH)


def check_toy(m):
  if m.hidden % 2:
    fail('model.hidden', f'{m.hidden} must be even; pick an even width')


def load_blobs(data_config, seed):
  """Three Gaussian blobs in `data.dim` >= 3 dimensions: 480 train and 120 test points."""
  rng = np.random.default_rng(0)
  centres = 4 * np.eye(3, data_config.dim)  # Apart by 4 sqrt(2) standard deviations.
  y = rng.integers(0, 3, size=600).astype(np.int32)
  x = (centres[y] + rng.normal(size=(600, data_config.dim))).astype(np.float32)
  return arrays_dataset(x[:480], y[:480], x[480:], y[480:], seed, num_classes=3)


def check_blobs(data_config):
  if data_config.get('dim', 0) <= 0:
    fail('data.dim', f'must be positive, got {data_config.get("dim")}')


@pytest.fixture
def registered(monkeypatch):
  """The one registry line of each, undone after the test."""
  monkeypatch.setitem(models.MODELS, 'toy', ModelFamily(Toy, task='classification',
                                                        check_config=check_toy))
  monkeypatch.setitem(data.DATASETS, 'blobs', DataSource(load_blobs, task='classification',
                                                         check_config=check_blobs))


def _config(**overrides):
  c = cfg.base_config()
  c.model.name, c.model.hidden = 'toy', 16
  c.data.name, c.data.dim = 'blobs', 4
  c.mesh.shape = (4, 2)
  c.train.update(steps=30, batch_size=32, log_every_steps=1)
  c.optimizer.learning_rate = 1e-2
  c.eval.update(every_steps=30, batch_size=32)
  c.checkpoint.every_steps = 30
  for key, value in overrides.items():
    group, field = key.split('.')
    c[group][field] = value
  return c


def test_a_registered_family_and_dataset_train_on_a_mesh(registered, tmp_path, devices):
  del registered, devices
  state = train.train_and_evaluate(_config(), str(tmp_path))
  rows = read_metrics(str(tmp_path))
  losses = [r['train/loss'] for r in rows if 'train/loss' in r]
  assert losses[-1] < 0.5 * losses[0], losses
  assert rows[-1]['eval/accuracy'] > 0.9  # Chance is about 1/3.
  # The hidden layer's units are split over 'model' by the standard rules, like the MLP's.
  kernel = state.params['hidden']['kernel']
  assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, 'model')
  with open(os.path.join(tmp_path, 'model_info.json'), encoding='utf-8') as f:
    table = {r['path']: r for r in json.load(f)['params']}
  assert table['hidden/kernel']['shard_shape'] == [4, 8]
  assert table['head/kernel']['logical_axes'] == ['mlp', 'classes']


@pytest.mark.parametrize('overrides,message', [
    ({'model.hidden': 15}, r'config\.model\.hidden: 15 must be even'),
    ({'data.dim': 0}, r'config\.data\.dim: must be positive, got 0'),
    ({'data.name': 'text'}, r"config\.data\.name: model 'toy' trains on classification data but "
                            r"'text' is lm data"),
])
def test_their_own_checks_reach_the_user(registered, overrides, message, tmp_path, devices):
  del registered, devices
  with pytest.raises(ConfigError, match=message):
    train.train_and_evaluate(_config(**overrides), str(tmp_path / 'run'))
  assert not (tmp_path / 'run').exists()


def test_unregistered_names_are_listed(tmp_path, devices):
  del devices
  with pytest.raises(ConfigError, match=r"unknown model 'toy'; known: mlp, cnn"):
    train.train_and_evaluate(_config(), str(tmp_path / 'run'))


def test_the_readmes_example_family_trains(registered, monkeypatch, tmp_path, devices):
  """docs/architecture.md's "Adding a model" file, exactly as written there."""
  del registered, devices
  with open(os.path.join(os.path.dirname(__file__), '..', 'docs', 'architecture.md'),
            encoding='utf-8') as f:
    snippet = re.search(r'```python\n(# zoo/models/wide_mlp\.py\n.*?)```', f.read(), re.S).group(1)
  module = types.ModuleType('wide_mlp')
  exec(snippet, module.__dict__)  # pylint: disable=exec-used
  monkeypatch.setitem(models.MODELS, 'wide_mlp', module.FAMILY)
  config = _config(**{'model.name': 'wide_mlp'})
  del config.model.hidden
  config.model.width = 100
  with pytest.raises(ConfigError, match=r'config\.model\.width: 100 is not a multiple of 128'):
    train.train_and_evaluate(config, str(tmp_path / 'bad'))
  config.model.width = 128
  train.train_and_evaluate(config, str(tmp_path / 'run'))
  assert read_metrics(str(tmp_path / 'run'))[-1]['eval/accuracy'] > 0.9
