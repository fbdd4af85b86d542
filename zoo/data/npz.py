"""Users' own arrays in a `.npz` file: `data.name = 'npz'`, `data.path = FILE`.

Classification: `x_train, y_train, x_test, y_test` (inputs of any shape per example,
integer labels); the number of classes is the largest label + 1. Language modelling:
`train_tokens, test_tokens` (1-D integer arrays) and optionally `vocab_size` (else the
largest token + 1). The model adapts: an MLP flattens any input, a CNN takes [H, W] or
[H, W, C] images, an LM takes the vocabulary size.
"""
import os

import ml_collections
import numpy as np

from zoo.data.dataset import DataSource, Dataset, arrays_dataset, token_windows
from zoo.errors import ConfigError, fail

CLASSIFICATION = ('x_train', 'y_train', 'x_test', 'y_test')
LANGUAGE = ('train_tokens', 'test_tokens')


def load(data_config: ml_collections.ConfigDict, seed: int) -> Dataset:
  with np.load(data_config.path) as f:
    arrays = dict(f)
  if set(CLASSIFICATION) <= set(arrays):
    x_train, y_train, x_test, y_test = (arrays[k] for k in CLASSIFICATION)
    if len(x_train) != len(y_train) or len(x_test) != len(y_test):
      raise ConfigError(f'config.data.path: {data_config.path} has x_train/y_train or '
                        'x_test/y_test of different lengths')
    num_classes = int(max(y_train.max(), y_test.max())) + 1
    return arrays_dataset(x_train.astype(np.float32), y_train.astype(np.int32),
                          x_test.astype(np.float32), y_test.astype(np.int32), seed, num_classes)
  if set(LANGUAGE) <= set(arrays):
    if 'seq_len' not in data_config:
      raise ConfigError(f'config.data.path: {data_config.path} holds language data (train_tokens, '
                        'test_tokens); train it with a language-model experiment such as char_lm')
    train, test = (arrays[k].astype(np.int32).reshape(-1) for k in LANGUAGE)
    vocab = (int(arrays['vocab_size']) if 'vocab_size' in arrays
             else int(max(train.max(), test.max())) + 1)
    if len(test) < data_config.seq_len + 1:
      raise ConfigError(f'config.data.path: test_tokens has {len(test)} tokens, fewer than '
                        f'data.seq_len + 1 = {data_config.seq_len + 1}')
    return token_windows(train, test, data_config.seq_len, seed, vocab,
                         decode=lambda ids: ' '.join(str(int(i)) for i in ids))
  raise ConfigError(f'config.data.path: {data_config.path} holds {sorted(arrays)}; give '
                    f'{", ".join(CLASSIFICATION)} (classification) or {", ".join(LANGUAGE)} '
                    '(language)')


def check_config(data_config: ml_collections.ConfigDict) -> None:
  if not os.path.isfile(data_config.path):
    fail('data.path', f'{data_config.path!r} is not a file; give a .npz file with x_train, '
         'y_train, x_test, y_test (classification) or train_tokens, test_tokens (language)')


SOURCE = DataSource(load, task=None, check_config=check_config)  # The file decides the task.
