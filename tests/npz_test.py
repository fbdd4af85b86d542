"""Users' own arrays (`data.name='npz'`): any classifier or the LM trains with no code."""
import json

import numpy as np
import pytest

from conftest import load_config, read_metrics
from zoo.errors import ConfigError
from zoo.run import train


@pytest.fixture(scope='module')
def files(tmp_path_factory):
  root = tmp_path_factory.mktemp('npz')
  rng = np.random.default_rng(0)
  # Three classes, each brightening one channel of 6x6x3 noise: learnable, not guessable.
  y = rng.integers(0, 3, size=300)
  x = (rng.normal(size=(300, 6, 6, 3)) + np.eye(3)[y][:, None, None, :]).astype(np.float32)
  np.savez(root / 'cls.npz', x_train=x[:240], y_train=y[:240], x_test=x[240:], y_test=y[240:])
  tokens = np.tile(np.arange(20), 300)  # A sequence an LM can learn exactly.
  np.savez(root / 'lm.npz', train_tokens=tokens[:5000], test_tokens=tokens[5000:])
  np.savez(root / 'bad.npz', images=x)
  return root


def _run(experiment, path, workdir, **overrides):
  config = load_config(experiment, **{'data.name': 'npz', 'data.path': str(path),
                                      'mesh.shape': (4, 2), **overrides})
  train.train_and_evaluate(config, str(workdir))
  with open(workdir / 'model_info.json', encoding='utf-8') as f:
    shapes = {p['path']: p['shape'] for p in json.load(f)['params']}
  return read_metrics(str(workdir))[-1], shapes


@pytest.mark.parametrize('experiment,first,head', [
    ('mlp_digits', 'hidden_0/kernel', 'head/kernel'), ('cnn_digits', 'conv_0/kernel', 'head/kernel')])
def test_classifiers_adapt_to_the_file(experiment, first, head, files, tmp_path, devices):
  del devices
  last, shapes = _run(experiment, files / 'cls.npz', tmp_path, **{
      'train.batch_size': 64, 'eval.batch_size': 64})
  assert shapes[head][-1] == 3  # Classes: the largest label + 1.
  assert shapes[first][0] == 6 * 6 * 3 if experiment == 'mlp_digits' else shapes[first][2] == 3
  majority = np.bincount(np.load(files / 'cls.npz')['y_test']).max() / 60
  assert majority < 0.45 and last['eval/accuracy'] > 0.9  # Learned, not the likeliest class.


def test_language_model_on_token_arrays(files, tmp_path, devices):
  del devices
  last, shapes = _run('char_lm', files / 'lm.npz', tmp_path)
  assert shapes['embed'][0] == 128  # 20 tokens, padded to a multiple of 128.
  assert last['eval/accuracy'] > 0.9


@pytest.mark.parametrize('name,experiment,message', [
    ('bad.npz', 'mlp_digits', r"holds \['images'\]; give x_train, y_train, x_test, y_test"),
    ('lm.npz', 'mlp_digits', r'holds language data .* with a language-model experiment'),
    ('cls.npz', 'char_lm', r"holds classification data but model 'transformer_lm' trains on lm data"),
    ('missing.npz', 'mlp_digits', r"config\.data\.path: '.*missing\.npz' is not a file"),
])
def test_bad_files_fail_clearly(name, experiment, message, files, tmp_path, devices):
  del devices
  with pytest.raises(ConfigError, match=message):
    _run(experiment, files / name, tmp_path / 'run')
  assert not (tmp_path / 'run').exists()
