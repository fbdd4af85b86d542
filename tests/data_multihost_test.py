"""File-backed datasets over several processes: each reads only its rows, the logged
figures equal one process's, and a checkpoint that 2 processes wrote resumes exactly in 1:
a mixture of two token datasets, LoRA on an imported model (only its adapters train)
reading a token dataset, and a record dataset; the mixture also on 4 processes with its
packed rows' sequence split over a 'context' axis across them. A plain token dataset, the
data and the workdir in a bucket, is gcs_test's
test_two_processes_read_their_rows_of_a_bucket_dataset_... (char_lm from scratch: the same
run, the same assertions)."""
import json
import logging
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, experiment, llama, load_config, numpy_hf, read_metrics
from zoo.data import digits, writer
from zoo.run import train

STEPS = 4  # Checkpoints at STEPS and 2 * STEPS.
DOCUMENTS = [f'Document {i}. ' + 'Pack my box with five dozen liquor jugs. ' * (3 + i % 5)
             for i in range(50)]


@pytest.fixture(scope='module')
def datasets(tmp_path_factory):
  """A byte-token dataset (for LoRA), a two-source mixture of token datasets (the small
  source crosses its epochs within the run) and a digits record dataset: (experiment, its
  arg, data flags)."""
  root = tmp_path_factory.mktemp('datasets')
  for name, docs in (('docs', DOCUMENTS), ('few', DOCUMENTS[:6])):
    with open(root / f'{name}.jsonl', 'w', encoding='utf-8') as f:
      f.writelines(json.dumps({'text': d}) + '\n' for d in docs)
  digits.write_image_folder(str(root / 'png'))
  # What `python -m zoo.prepare` writes (its writer, in this process: the command's own
  # start-up is prepare_test's).
  for kind, source, output, val_fraction in (('text', 'docs.jsonl', 'tokens', 0.2),
                                             ('text', 'few.jsonl', 'few', 0.2),
                                             ('images', 'png', 'records', 0.01)):
    writer.run(kind, writer.Options(inputs=(str(root / source),), output=str(root / output),
                                    val_fraction=val_fraction))
  from zoo.hf import transfer  # pylint: disable=import-outside-toplevel
  # A tiny random Llama (as save_pretrained lays it out) to tune with LoRA.
  numpy_hf(root / 'llama', llama(hidden_size=64, intermediate_size=128, num_hidden_layers=2))
  transfer.import_model(str(root / 'llama'), str(root / 'imported'))
  return {'lora': ('finetune_lm', f'{root}/imported,smoke,lora', {'data.path': f'{root}/tokens'}),
          'mixture': ('bpe_lm', 'smoke,mixture', {'data.sources.code': f'{root}/tokens',
                                                  'data.sources.docs': f'{root}/few',
                                                  'data.weights.docs': 0.8}),
          'records': ('cnn_digits', 'smoke', {'data.name': 'records',
                                              'data.path': f'{root}/records'})}


# name -> the multi-process job's processes and mesh where it is not 2 on (4,2) (the
# 1-process reference and resume run on (4,2)). Over batch 2 x context 4 on 4 processes of
# 2 devices, each process reads the rows of its 'batch' block and places half of their
# sequence.
SPLIT = {'mixture_context': (4, {'mesh.axes': "('batch','context','model')",
                                 'mesh.shape': '(2,4,1)'})}


def _flags(data_flags):
  # No eval sample: on 2 processes each of its tokens is a forward with collectives over
  # TCP (4 CPU-s a job); gcs_test's 2 processes sample.
  return {**data_flags, 'train.steps': 2 * STEPS, 'train.log_every_steps': 1,
          'eval.every_steps': 2 * STEPS, 'checkpoint.every_steps': STEPS, 'mesh.shape': '(4,2)',
          'eval.sample': False}


def _rows(workdir):
  return [{k: v for k, v in r.items() if not k.startswith('perf/')} for r in read_metrics(workdir)]


@pytest.mark.parametrize('name', ['mixture', 'mixture_context', 'lora', 'records'])
def test_two_processes_read_half_each_and_resume_in_one(name, datasets, tmp_path, devices,
                                                         caplog):
  del devices
  experiment_name, arg, data_flags = datasets[name.replace('_context', '')]
  processes, mesh = SPLIT.get(name, (2, {}))
  flags = _flags(data_flags)
  def config():  # A fresh config for each run.
    return load_config(experiment_name, arg, **{**flags, 'mesh.shape': (4, 2)})
  reference = str(tmp_path / 'one')
  train.train_and_evaluate(config(), reference)  # 1 process, 8 devices.
  args = [f'--config={experiment(experiment_name)}:{arg}',
          *(f'--config.{k}={v}' for k, v in {**flags, **mesh}.items())]
  workdir = tmp_path / 'two'
  result = subprocess.run(
      [sys.executable, os.path.join(REPO, 'launch', 'local.py'), f'--processes={processes}',
       f'--devices={8 // processes}',
       '--heartbeat_timeout=30', '--', *args, f'--workdir={workdir}'],
      cwd=REPO, capture_output=True, text=True, timeout=240, check=False)
  assert result.returncode == 0, result.stdout[-3000:]
  assert 'sample at' not in result.stdout  # eval.sample=False: none.
  batch = load_config(experiment_name, arg).train.batch_size
  for i in range(processes):  # Each process read its half of every step's batch, no more.
    read = re.search(rf'\[process {i}\] .*process {i} read (\d+) training examples for '
                     rf'{2 * STEPS} steps', result.stdout)
    assert read and int(read.group(1)) == 2 * STEPS * batch // 2, result.stdout[-3000:]
  if mesh:  # Each places only its half of its rows' (packed, load-balanced) sequence.
    with open(workdir / 'model_info.json', encoding='utf-8') as f:
      assert json.load(f)['feed'] == {
          'rows': {'0': [0, 8], '1': [0, 8], '2': [8, 16], '3': [8, 16]},
          'positions': {'0': [[0, 16]], '1': [[16, 32]], '2': [[0, 16]], '3': [[16, 32]]}}
  if name.startswith('mixture'):  # The small source went round more than once: epochs cross.
    assert re.search(r'few: train split: \d+ documents packed into (\d+) windows', result.stdout)
    windows = int(re.search(r'few: train split: \d+ documents packed into (\d+) windows',
                            result.stdout).group(1))
    assert 2 * STEPS * batch * 0.8 > 1.5 * windows, windows
  assert _close(_rows(str(workdir)), _rows(reference))  # 2 processes compute what 1 does.
  # Keep the 2 processes' checkpoint at STEPS; one process (this one, 8 devices, as the
  # reference) resumes from it.
  shutil.rmtree(workdir / 'checkpoints' / str(2 * STEPS))
  with caplog.at_level(logging.INFO, logger='absl'):  # zoo logs through absl.
    train.train_and_evaluate(config(), str(workdir))
  assert f'resuming from step {STEPS}' in caplog.text
  assert _close(_rows(str(workdir)), _rows(reference))


def _close(rows, reference, rtol=2e-5):
  """Every row has the reference's keys and values (cross-process reductions may reorder
  float sums, so within rtol)."""
  assert [r['step'] for r in rows] == [r['step'] for r in reference]
  for row, want in zip(rows, reference):
    assert row.keys() == want.keys()
    assert row == pytest.approx(want, rel=rtol), (row, want)
  return True
