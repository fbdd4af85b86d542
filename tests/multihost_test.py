"""Several real processes on 127.0.0.1 form one JAX job (jax.distributed, gloo on CPU)."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import (GPT2, REPO, cli_env, experiment, load_config, numpy_hf, read_metrics,
                      run_cli)
from zoo.run import train

STEPS = 6
# A constant learning rate in every run: the compiled programs do not depend on
# train.steps, so the endless runs below load the 2-process job's programs from the cache.
FLAGS = [f'--config={experiment("mlp_digits")}:smoke', '--config.train.log_every_steps=1',
         f'--config.eval.every_steps={STEPS}', f'--config.checkpoint.every_steps={STEPS}',
         '--config.optimizer.schedule=constant']


# A run that only stops when told to (or killed).
ENDLESS = ['--config.train.steps=100000', '--config.mesh.shape=(4,2)',
           '--config.checkpoint.every_steps=100000', '--config.eval.every_steps=100000']


def launch(*args, processes=2, devices=4, timeout=240):
  cmd = [sys.executable, os.path.join(REPO, 'launch', 'local.py'), f'--processes={processes}',
         f'--devices={devices}', '--heartbeat_timeout=30', '--', *args]
  return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False)


def _losses(workdir):
  rows = [r for r in read_metrics(workdir) if 'train/loss' in r]
  return np.array([r['train/loss'] for r in rows]), [r['step'] for r in rows]


@pytest.fixture(scope='module')
def one_process(tmp_path_factory):
  """1 process x 8 devices: the reference for every multi-process run, up to 3 x STEPS. It
  saves once, at its end: how often a run saves changes nothing it computes."""
  workdir = str(tmp_path_factory.mktemp('one'))
  train.train_and_evaluate(load_config('mlp_digits', **{
      'train.steps': 3 * STEPS, 'train.log_every_steps': 1, 'eval.every_steps': STEPS,
      'checkpoint.every_steps': 3 * STEPS, 'mesh.shape': (4, 2),
      'optimizer.schedule': 'constant'}), workdir)
  return _losses(workdir)[0]


@pytest.fixture(scope='module')
def two_processes(tmp_path_factory):
  """2 processes x 4 devices on (4,2), 3 x STEPS steps, a checkpoint every STEPS: the launch
  test_two_processes_match_one checks and test_checkpoints_move_between_process_counts
  resumes from (each test reads it, or a copy of it)."""
  workdir = tmp_path_factory.mktemp('two')
  result = launch(*FLAGS, f'--workdir={workdir}', f'--config.train.steps={3 * STEPS}',
                  '--config.mesh.shape=(4,2)')
  return workdir, result


def test_two_processes_match_one(one_process, two_processes):
  workdir, result = two_processes
  assert result.returncode == 0, result.stdout[-3000:]
  losses, steps = _losses(str(workdir))
  assert steps == list(range(1, 3 * STEPS + 1))  # Only process 0 writes metrics.
  np.testing.assert_allclose(losses, one_process, rtol=2e-5)
  with open(workdir / 'model_info.json', encoding='utf-8') as f:  # Each holds 2 'batch' rows.
    assert json.load(f)['mesh_processes'] == [[0, 0], [0, 0], [1, 1], [1, 1]]
  for i in (0, 1):  # Both processes ran the same steps with the same losses.
    assert f'[process {i}] ' in result.stdout
    assert re.search(rf'\[process {i}\].*step {3 * STEPS}/{3 * STEPS}  loss', result.stdout)


# (A plain mesh, each process holding a 'batch' row, is test_two_processes_match_one's.)
@pytest.mark.parametrize('dcn,layout', [
    ((1, 2), [[0, 0, 1, 1], [0, 0, 1, 1]]),   # 2 slices along 'model': each holds half of it.
])
def test_hybrid_mesh_places_slices_along_the_dcn_axes(dcn, layout, one_process, tmp_path):
  """Processes stand in for slices; the layout changes, the losses do not."""
  result = launch(*FLAGS, f'--workdir={tmp_path}', f'--config.train.steps={3 * STEPS}',
                  '--config.mesh.shape=(2,4)', f'--config.mesh.dcn_shape=({dcn[0]},{dcn[1]})')
  assert result.returncode == 0, result.stdout[-3000:]
  with open(tmp_path / 'model_info.json', encoding='utf-8') as f:
    assert json.load(f)['mesh_processes'] == layout
  np.testing.assert_allclose(_losses(str(tmp_path))[0], one_process, rtol=2e-5)


def test_checkpoints_move_between_process_counts(one_process, two_processes, tmp_path):
  """2 processes write on (4,2); 1 process with 2 devices resumes on (2,1); 2 processes
  resume from its step on (4,2) (the writer's programs, loaded from the cache)."""
  written, result = two_processes  # 2 processes on (4,2), a checkpoint every STEPS.
  assert result.returncode == 0, result.stdout[-3000:]
  shutil.copytree(written, tmp_path, dirs_exist_ok=True)  # test_two_processes_match_one reads it.
  workdir = f'--workdir={tmp_path}'
  # Keep only step STEPS, as if the 2-process job had been stopped there.
  for step in (2 * STEPS, 3 * STEPS):
    os.rename(tmp_path / 'checkpoints' / str(step), tmp_path / f'set_aside_{step}')
  result = run_cli(*FLAGS, workdir, f'--config.train.steps={3 * STEPS}', '--config.mesh.shape=(2,1)',
                   devices=2)
  assert result.returncode == 0, result.stderr[-3000:]
  assert f'resuming from step {STEPS}' in result.stderr
  # Keep up to step 2 * STEPS, which the single process wrote.
  os.rename(tmp_path / 'checkpoints' / str(3 * STEPS), tmp_path / 'set_aside_last')
  result = launch(*FLAGS, workdir, f'--config.train.steps={3 * STEPS}', '--config.mesh.shape=(4,2)')
  assert result.returncode == 0, result.stdout[-3000:]
  assert f'resuming from step {2 * STEPS}' in result.stdout
  losses, steps = _losses(str(tmp_path))
  assert steps == list(range(1, 3 * STEPS + 1))
  np.testing.assert_allclose(losses, one_process, rtol=2e-5)


HEARTBEAT = 10  # Seconds without heartbeats after which a process counts as dead.


def _start(i, port, workdir):
  env = cli_env()
  cmd = [sys.executable, '-m', 'zoo.main', '--cpu_devices=4', f'--coordinator_address=127.0.0.1:{port}',
         '--num_processes=2', f'--process_id={i}', f'--heartbeat_timeout={HEARTBEAT}', *FLAGS,
         f'--workdir={workdir}', *ENDLESS]
  return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize('victim', [1, 0])
def test_survivor_exits_nonzero_in_bounded_time(victim, tmp_path):
  """The survivor of a SIGKILLed peer aborts with JAX's termination message: within the
  heartbeat timeout when process 1 dies (measured 10.6 s), at once when the coordinator
  (process 0) does (measured 0.2 s). A survivor that was inside a collective with the
  dead peer (its TCP link reset: 1 of 18 runs here) ends at once as one zoo line."""
  sys.path.insert(0, os.path.join(REPO, 'launch'))
  import local  # pylint: disable=import-outside-toplevel
  port = local.free_port()
  procs = [_start(i, port, tmp_path) for i in (0, 1)]
  try:
    deadline = time.time() + 120
    while not (tmp_path / 'metrics.jsonl').exists() or (tmp_path / 'metrics.jsonl').stat().st_size == 0:
      assert time.time() < deadline and all(p.poll() is None for p in procs), 'training did not start'
      time.sleep(0.1)
    procs[victim].send_signal(signal.SIGKILL)
    killed = time.time()
    survivor = procs[1 - victim]
    rc = survivor.wait(timeout=110)
    elapsed = time.time() - killed
    stderr = survivor.stderr.read()
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  print(f'process {1 - victim} exited {rc} after {elapsed:.1f} s')
  if rc == 1:  # The collective failed before the heartbeat ran out.
    assert 'Traceback' not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1].startswith(
        'zoo: error: a collective with the other processes failed (UNKNOWN: Gloo '), stderr[-2000:]
    assert elapsed < 5, f'survivor took {elapsed:.1f} s'
    return
  assert rc == -signal.SIGABRT, stderr[-2000:]
  assert ('Terminating process because the JAX distributed service detected fatal errors. This '
          'most likely indicates that another task died') in stderr, stderr[-2000:]
  # The heartbeat timeout, plus a margin for a loaded machine; the coordinator's death is
  # noticed at once (its peers' connection closes).
  assert elapsed < (HEARTBEAT + 5 if victim else 5), f'survivor took {elapsed:.1f} s'


@pytest.fixture
def endless(tmp_path):
  """Starts the launcher on a run that never ends by itself; kills it after the test."""
  procs = []
  def start():
    cmd = [sys.executable, os.path.join(REPO, 'launch', 'local.py'), '--processes=2',
           '--devices=4', '--', *FLAGS, f'--workdir={tmp_path}', *ENDLESS]
    procs.append(subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True))
    return procs[-1]
  yield start
  for p in procs:
    if p.poll() is None:
      p.kill()  # Its children die with it (PR_SET_PDEATHSIG).
      p.wait()


def test_launcher_stops_the_others_when_one_fails(endless):
  proc = endless()
  pids = {}
  for line in proc.stdout:
    match = re.match(r'\[launch\] process (\d): pid (\d+)', line)
    if match:
      pids[int(match.group(1))] = int(match.group(2))
    if 'step 3/' in line:
      break
  os.kill(pids[1], signal.SIGKILL)
  t0 = time.time()
  rest = proc.stdout.read()
  rc = proc.wait(timeout=60)
  assert rc == 128 + signal.SIGKILL and time.time() - t0 < 30
  assert 'process 1 exited with -9; stopping the others' in rest
  with pytest.raises(ProcessLookupError):
    os.kill(pids[0], 0)  # Process 0 is gone too.


@pytest.mark.parametrize('flag', ['--process_id=3', '-num_processes=2'])
def test_launcher_rejects_its_own_flags(flag):
  result = subprocess.run([sys.executable, os.path.join(REPO, 'launch', 'local.py'), '--', flag],
                          capture_output=True, text=True, check=False)
  assert result.returncode == 2 and 'set by the launcher' in result.stderr


def test_sigterm_to_every_process_saves_one_agreed_step(endless, tmp_path):
  """JAX's preemption service catches SIGTERM; orbax's sync point picks one step for all."""
  proc = endless()
  for line in proc.stdout:
    if 'step 5/' in line:
      break
  proc.send_signal(signal.SIGTERM)  # The launcher passes it on to both processes.
  rest = proc.stdout.read()
  assert proc.wait(timeout=60) == 0, rest[-3000:]
  saved = [int(s) for s in os.listdir(tmp_path / 'checkpoints') if s.isdigit()]
  assert len(saved) == 1 and saved[0] == max(_losses(str(tmp_path))[1])
  for i in (0, 1):
    assert re.search(rf'\[process {i}\] .*stop requested \(SIGTERM or preemption\) at step {saved[0]}:',
                     rest), rest[-3000:]


@pytest.fixture(scope='module')
def imported_gpt2(tmp_path_factory):
  """A tiny random GPT-2 directory and its zoo import."""
  from zoo.hf import transfer  # pylint: disable=import-outside-toplevel
  root = tmp_path_factory.mktemp('mp_gpt2')
  hf = numpy_hf(root / 'hf', GPT2)
  transfer.import_model(hf, str(root / 'run'))
  return hf, str(root / 'run')


def test_a_command_failing_on_one_process_ends_its_peer_within_the_heartbeat(imported_gpt2,
                                                                             tmp_path):
  """Two-process zoo.sample and zoo.convert import where process 1 cannot see its input (a
  path not mounted on its host): it exits 1 with one line naming it, and process 0, which
  goes on into the job's collectives, ends within the heartbeat timeout instead of waiting.
  The two commands' jobs run at once (their waits for the heartbeat overlap)."""
  sys.path.insert(0, os.path.join(REPO, 'launch'))
  import local  # pylint: disable=import-outside-toplevel
  hf, run = imported_gpt2
  missing = str(tmp_path / 'not-mounted')
  env = cli_env()
  jobs = {}
  for command in ('sample', 'import'):
    port, procs = local.free_port(), []
    for i in (0, 1):
      if command == 'sample':
        args = ['zoo.sample', f'--workdir={run if i == 0 else missing}', '--num_tokens=3']
      else:
        args = ['zoo.convert', 'import', f'--hf_dir={hf if i == 0 else missing}',
                f'--workdir={tmp_path / "imported"}']
      procs.append(subprocess.Popen(
          [sys.executable, '-m', *args, '--cpu_devices=2', f'--coordinator_address=127.0.0.1:{port}',
           '--num_processes=2', f'--process_id={i}', f'--heartbeat_timeout={HEARTBEAT}'],
          cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    jobs[command] = procs
  ended = {}  # Each process's exit time, polled: the two jobs end in any order.
  deadline = time.time() + 120 + HEARTBEAT + 60
  try:
    while len(ended) < 4 and time.time() < deadline:
      for p in (p for procs in jobs.values() for p in procs):
        if p not in ended and p.poll() is not None:
          ended[p] = time.time()
      time.sleep(0.05)
  finally:
    for p in (p for procs in jobs.values() for p in procs):
      if p.poll() is None:
        p.kill()
  outcomes = {command: (procs[1].wait(), procs[0].wait(),
                        ended.get(procs[0], float('inf')) - ended.get(procs[1], 0.0),
                        [p.stderr.read() for p in procs]) for command, procs in jobs.items()}
  for command, (failed, survivor, elapsed, stderr) in outcomes.items():
    flag = '--workdir' if command == 'sample' else '--hf_dir'
    assert failed == 1, stderr[1][-2000:]
    assert stderr[1].strip().splitlines()[-1].startswith(f'zoo: error: {flag}: {missing} '), stderr[1][-2000:]
    assert survivor != 0, stderr[0][-2000:]
    assert elapsed < HEARTBEAT + 10, f'{command}: process 0 took {elapsed:.1f} s'


def test_the_local_launcher_sets_the_device_count_and_keeps_other_xla_flags():
  sys.path.insert(0, os.path.join(REPO, 'launch'))
  import local  # pylint: disable=import-outside-toplevel
  env = local.process_env({'XLA_FLAGS': '--xla_dump_to=/tmp/d '
                                        '--xla_force_host_platform_device_count=8',
                           'JAX_NUM_CPU_DEVICES': '8', 'HOME': '/h'})
  assert env == {'XLA_FLAGS': '--xla_dump_to=/tmp/d', 'HOME': '/h', 'PYTHONUNBUFFERED': '1'}
  assert 'XLA_FLAGS' not in local.process_env(
      {'XLA_FLAGS': '--xla_force_host_platform_device_count=2'})
