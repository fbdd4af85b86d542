"""File-backed datasets over several processes: each reads only its rows, the losses equal
one process's, and a checkpoint that 2 processes wrote resumes exactly in 1."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, experiment, load_config, read_metrics, run_cli
from zoo.data import digits
from zoo.run import train

STEPS = 4  # Checkpoints at STEPS and 2 * STEPS.
DOCUMENTS = [f'Document {i}. ' + 'Pack my box with five dozen liquor jugs. ' * (3 + i % 5)
             for i in range(50)]


@pytest.fixture(scope='module')
def datasets(tmp_path_factory):
  """A byte-token dataset and a digits record dataset."""
  root = tmp_path_factory.mktemp('datasets')
  with open(root / 'docs.jsonl', 'w', encoding='utf-8') as f:
    f.writelines(json.dumps({'text': d}) + '\n' for d in DOCUMENTS)
  digits.write_image_folder(str(root / 'png'))
  for args in (['text', f'--input={root}/docs.jsonl', f'--output={root}/tokens',
                '--val_fraction=0.2'],
               ['images', f'--input={root}/png', f'--output={root}/records']):
    result = subprocess.run([sys.executable, '-m', 'zoo.prepare', *args], cwd=REPO,
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
  return {'tokens': ('char_lm', str(root / 'tokens')), 'records': ('cnn_digits', str(root / 'records'))}


def _flags(name, path):
  return {'data.name': name, 'data.path': path, 'train.steps': 2 * STEPS, 'train.log_every_steps': 1,
          'eval.every_steps': 2 * STEPS, 'checkpoint.every_steps': STEPS, 'mesh.shape': '(4,2)'}


def _rows(workdir):
  return [{k: v for k, v in r.items() if not k.startswith('perf/')} for r in read_metrics(workdir)]


@pytest.mark.parametrize('name', ['tokens', 'records'])
def test_two_processes_read_half_each_and_resume_in_one(name, datasets, tmp_path, devices):
  del devices
  experiment_name, path = datasets[name]
  flags = _flags(name, path)
  reference = str(tmp_path / 'one')
  train.train_and_evaluate(load_config(experiment_name, **{
      **flags, 'mesh.shape': (4, 2)}), reference)
  args = [f'--config={experiment(experiment_name)}:smoke',
          *(f'--config.{k}={v}' for k, v in flags.items())]
  workdir = tmp_path / 'two'
  result = subprocess.run(
      [sys.executable, os.path.join(REPO, 'launch', 'local.py'), '--processes=2', '--devices=4',
       '--heartbeat_timeout=30', '--', *args, f'--workdir={workdir}'],
      cwd=REPO, capture_output=True, text=True, timeout=240, check=False)
  assert result.returncode == 0, result.stdout[-3000:]
  batch = load_config(experiment_name).train.batch_size
  for i in (0, 1):  # Each process read its half of every step's batch, and no more.
    read = re.search(rf'\[process {i}\] .*process {i} read (\d+) training examples for '
                     rf'{2 * STEPS} steps', result.stdout)
    assert read and int(read.group(1)) == 2 * STEPS * batch // 2, result.stdout[-3000:]
  assert _close(_rows(str(workdir)), _rows(reference))  # 2 processes compute what 1 does.
  # Keep the 2 processes' checkpoint at STEPS; one process resumes from it.
  shutil.rmtree(workdir / 'checkpoints' / str(2 * STEPS))
  result = run_cli(*args, f'--workdir={workdir}', devices=8)
  assert result.returncode == 0, result.stderr[-3000:]
  assert f'resuming from step {STEPS}' in result.stderr
  assert _close(_rows(str(workdir)), _rows(reference))


def _close(rows, reference, rtol=2e-5):
  """Every row has the reference's keys and values (cross-process reductions may reorder
  float sums, so within rtol)."""
  assert [r['step'] for r in rows] == [r['step'] for r in reference]
  for row, want in zip(rows, reference):
    assert row.keys() == want.keys()
    assert row == pytest.approx(want, rel=rtol), (row, want)
  return True
