"""Each experiment's smoke variant trains end to end, learns, and writes its outputs."""
import glob
import json
import os

import pytest

from conftest import load_config, read_metrics
from zoo.run import train

# name -> (held-out metric, what the smoke run must reach: it learns beyond chance).
EXPERIMENTS = {
    'mlp_digits': ('eval/accuracy', lambda v: v > 0.85),      # Chance: 0.1.
    'cnn_digits': ('eval/accuracy', lambda v: v > 0.7),
    'resnet_digits': ('eval/accuracy', lambda v: v > 0.7),
    'vit_digits': ('eval/accuracy', lambda v: v > 0.4),
    # Below the corpus's unigram entropy (4.69 bits): the model uses context.
    'char_lm': ('eval/bits_per_char', lambda v: v < 4.3),
    'moe_lm': ('eval/bits_per_char', lambda v: v < 4.3),
    # Per-digit accuracy above chance (0.1); exact match needs the full run.
    'seq_sort': ('eval/accuracy', lambda v: v > 0.2),
}


@pytest.mark.parametrize('name', sorted(EXPERIMENTS))
def test_smoke_trains_and_writes_outputs(name, tmp_path, devices):
  del devices
  config = load_config(name, **{'mesh.shape': (4, 2), 'train.log_every_steps': 1})
  workdir = str(tmp_path / 'run')
  train.train_and_evaluate(config, workdir)

  rows = read_metrics(workdir)
  losses = [r['train/loss'] for r in rows if 'train/loss' in r]
  assert losses[-1] < 0.8 * losses[0], f'loss did not drop: {losses}'
  last = rows[-1]
  metric, reached = EXPERIMENTS[name]
  assert last['step'] == config.train.steps and reached(last[metric]), last
  train_row = [r for r in rows if 'train/loss' in r][-1]
  for key in ('perf/step_time_s', 'perf/data_wait_s', 'perf/examples_per_s', 'perf/flops_per_step', 'perf/mfu',
              'train/grad_norm', 'train/param_norm', 'train/learning_rate'):
    assert key in train_row
  assert train_row['perf/mfu'] > 0 and train_row['perf/flops_per_step'] > 0
  assert ('perf/tokens_per_s' in train_row) == (name in ('char_lm', 'moe_lm', 'seq_sort'))
  assert glob.glob(os.path.join(workdir, 'events.out.tfevents.*'))
  with open(os.path.join(workdir, 'config.json'), encoding='utf-8') as f:
    assert json.load(f)['train']['steps'] == config.train.steps
  with open(os.path.join(workdir, 'model_info.json'), encoding='utf-8') as f:
    info = json.load(f)
  assert info['mesh'] == {'batch': 4, 'model': 2}
  assert {'path', 'shape', 'dtype', 'logical_axes', 'partition_spec'} <= set(info['params'][0])
  assert info['step_cost']['model_flops'] == train_row['perf/flops_per_step']


@pytest.mark.parametrize('name', sorted(EXPERIMENTS))
def test_unknown_variant_is_rejected(name):
  with pytest.raises(ValueError, match='known: smoke'):
    load_config(name, arg='smol')
