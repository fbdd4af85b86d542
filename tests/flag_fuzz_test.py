"""Bad values in every flag of every command: each case runs the whole command and ends
either in success or in one `zoo: error:` line that names the flag; never a traceback,
never a hang. The cases come from the flags themselves (each command module's flags, by
type), so a new flag is covered without editing this test.

Each command's cases run in one process (tests/flag_fuzz_driver.py): absl flags are
global and re-parsed per case, and the command runs through the shell's own error
handling. The shell's device flags (--cpu_devices, the multi-process trio and its
timeouts) shape the JAX runtime, which starts once per process: they are tried one
process each, in the last test.
"""
import json
import os
import socket
import subprocess
import sys

import pytest

from conftest import GPT2, REPO, cli_env, experiment, numpy_hf
from prepare_test import _images

DRIVER = os.path.join(os.path.dirname(__file__), 'flag_fuzz_driver.py')
SECONDS = 60  # A case's bound: one that runs longer fails the test.


@pytest.fixture(scope='module')
def inputs(tmp_path_factory):
  """What the commands' baselines read: a tiny random GPT-2 as save_pretrained lays it out
  (import), that model imported (sample, export) and a small JSON Lines corpus (prepare)."""
  from zoo.hf import transfer  # pylint: disable=import-outside-toplevel
  root = tmp_path_factory.mktemp('flag_fuzz')
  numpy_hf(root / 'hf', GPT2)
  transfer.import_model(str(root / 'hf'), str(root / 'run'))
  corpus = root / 'docs.jsonl'
  corpus.write_text(''.join(json.dumps({'text': f'document {i}: a few words ' * 3}) + '\n'
                            for i in range(200)))
  _images(root / 'images', sizes=((8, 8),) * 3, classes=('a', 'b'))
  (root / 'tasks').mkdir()  # A harness task over a local file (zoo.evaluate).
  (root / 'tasks' / 'items.jsonl').write_text(''.join(json.dumps(
      {'context': f'document {i}:', 'choices': [' a few', ' words'], 'answer': i % 2}) + '\n'
      for i in range(4)))
  (root / 'tasks' / 'fuzz_choice.yaml').write_text(
      'task: fuzz_choice\ndataset_path: json\ndataset_kwargs:\n  data_files:\n'
      f'    test: {root}/tasks/items.jsonl\ntest_split: test\noutput_type: multiple_choice\n'
      'doc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
      'metric_list:\n  - metric: acc\n')
  return {'run': str(root / 'run'), 'hf': str(root / 'hf'), 'corpus': str(corpus),
          'images': str(root / 'images'), 'out': str(root / 'out'), 'tasks': str(root / 'tasks')}


# Each command: its module, the arguments of a cheap run that succeeds, and what a flag
# needs beside them to matter (a flag that only works with another).
COMMANDS = {
    'main': ('zoo.main', ['--config={mlp}:smoke', '--dry_run'],
             {'num_slices': ['--topology=v5litepod-4'], 'max_batch': ['--topology=v5litepod-4']}),
    'sample': ('zoo.sample', ['--workdir={run}', '--num_tokens=3', '--prompt=ab'], {}),
    'import': ('zoo.convert', ['import', '--hf_dir={hf}', '--workdir={out}'], {}),
    'export': ('zoo.convert', ['export', '--workdir={run}', '--hf_dir={out}'], {}),
    'prepare text': ('zoo.prepare', ['text', '--input={corpus}', '--output={out}',
                                     '--val_fraction=0.1', '--vocab_size=300', '--tokenizer=bpe'],
                     {}),
    'prepare images': ('zoo.prepare', ['images', '--input={images}', '--output={out}'], {}),
    'evaluate': ('zoo.evaluate', ['--workdir={run}', '--tasks=fuzz_choice',
                                  '--include_path={tasks}', '--batch_size=2'],
                 {'log_samples': ['--output={out}']}),
}


@pytest.mark.parametrize('command', list(COMMANDS))
def test_every_flag_with_a_bad_value_succeeds_or_names_the_flag(command, inputs):
  module, baseline, extra = COMMANDS[command]
  values = {'mlp': experiment('mlp_digits'), **inputs}
  spec = {'module': module, 'baseline': [a.format(**values) for a in baseline],
          'extra': {k: v or [] for k, v in extra.items()}, 'seconds': SECONDS,
          'out': inputs['out']}
  run = subprocess.run([sys.executable, DRIVER, json.dumps(spec)], cwd=REPO, capture_output=True,
                       text=True, timeout=1800, check=False)
  assert run.returncode == 0, run.stderr[-5000:]
  results = [json.loads(line) for line in run.stdout.splitlines()]
  assert len(results) > 10, run.stdout
  assert results[-1]['outcome'] == 'ok', results[-1]  # The baseline works.
  bad = []
  for r in results[:-1]:
    line, flag = r['line'], r['flag']
    if r['outcome'] == 'ok':
      continue
    if (r['outcome'] != 'error' or not line.startswith('zoo: error: ') or '\n' in line
        or 'unexpected error' in line or f'--{flag}' not in line):
      bad.append(f'--{flag}={r["value"]!r} ({r["label"]}): {r["outcome"]}: {line[:300]}')
  assert not bad, '\n'.join(bad)


def _free_port():
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def test_the_shells_device_flags_with_bad_values_succeed_or_name_the_flag(inputs):
  """Values that parse, each in a process of its own (the JAX runtime starts once): the
  multi-process trio and its timeouts on a one-process job over loopback. The processes
  are forked by the driver once zoo.sample's imports are done (the start-up they share)."""
  sys.path.insert(0, os.path.dirname(DRIVER))
  from flag_fuzz_driver import DEVICE_FLAGS  # pylint: disable=import-outside-toplevel
  cases = []
  for flag in sorted(DEVICE_FLAGS):
    values = ({'unknown string': 'no-such-value'} if flag == 'coordinator_address' else
              {'zero': '0', 'negative': '-1', 'huge': str(10**9)})
    for label, value in values.items():
      job = [] if flag == 'cpu_devices' else [
          f'--coordinator_address=127.0.0.1:{_free_port()}', '--num_processes=1',
          '--process_id=0', '--initialization_timeout=10']
      cases.append((flag, label, [*job, f'--{flag}={value}']))
  spec = {'module': 'zoo.sample', 'seconds': SECONDS, 'parallel': 3,
          'cases': [[f'--workdir={inputs["run"]}', '--num_tokens=3', '--prompt=ab', *args]
                    for _, _, args in cases]}
  run = subprocess.run([sys.executable, DRIVER, '--processes', json.dumps(spec)], cwd=REPO,
                       env=cli_env(), capture_output=True, text=True,
                       timeout=SECONDS * len(cases), check=False)
  assert run.returncode == 0, run.stderr[-5000:]
  done = [json.loads(line) for line in run.stdout.splitlines()]
  assert [d['index'] for d in done] == list(range(len(cases))), run.stdout[-3000:]
  bad = []
  for (flag, label, args), d in zip(cases, done):
    line = (d['stderr'].strip().splitlines() or [''])[-1]
    if d['returncode'] is None:
      bad.append(f'{args[-1]} ({label}): no verdict in {SECONDS} s')
    elif d['returncode'] != 0 and (
        d['returncode'] != 1 or not line.startswith('zoo: error: ') or f'--{flag}' not in line
        or 'Traceback' in d['stderr']):
      bad.append(f'{args[-1]} ({label}): exit {d["returncode"]}: {line[:300]}')
  assert len(cases) >= 16
  assert not bad, '\n'.join(bad)
