"""One owner per workdir: a second job is refused, a dead owner's lease expires."""
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from conftest import REPO, experiment, read_metrics, run_cli
from crash_test import _start, _wait_for_step
from storage_test import ORBAX_INFO
from zoo.store import lease


def _args(workdir, steps):  # (A constant learning rate: runs of any length, one compile.)
  return [f'--config={experiment("mlp_digits")}:smoke', f'--workdir={workdir}',
          f'--config.train.steps={steps}', '--config.train.log_every_steps=1',
          f'--config.eval.every_steps={steps}', '--config.checkpoint.every_steps=2',
          '--config.optimizer.schedule=constant']


def _write_lease(workdir, **fields):
  """Another job's lease, written as a job writes it: whole, by a rename (a reader never
  sees the file empty or half written, which it would take for no lease at all)."""
  owner = {'host': 'elsewhere', 'pid': 4242, 'started': '2026-01-01T00:00:00+00:00',
           'token': 'theirs', 'renewed': time.time(), 'ttl': 60.0, **fields}
  (workdir / 'theirs.tmp').write_text(json.dumps(owner))
  os.replace(workdir / 'theirs.tmp', workdir / lease.LEASE)


def test_second_job_is_refused_and_a_killed_owner_does_not_block(tmp_path):
  workdir = tmp_path / 'run'
  with open(tmp_path / 'first.log', 'w', encoding='utf-8') as log:
    first = _start(str(workdir), log, *_args(workdir, 100_000))
  try:
    # Step 5 logged: the save of step 4 has begun, so step 2's is complete (a save waits for
    # the one before it).
    _wait_for_step(str(workdir), first, 5)
    # Paused, not ended: alive and holding a fresh lease, and not training on while the
    # second job starts (so the restart below stays a few steps long).
    first.send_signal(signal.SIGSTOP)
    second = run_cli(*_args(workdir, 10), timeout=120)
    rows_before_kill = read_metrics(workdir)
  finally:
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
  assert second.returncode != 0
  line = second.stderr.strip().splitlines()[-1]
  assert line.startswith(f'zoo: error: --workdir: {workdir} is owned by a live job (host '
                         f'{socket.gethostname()}, process {first.pid}, started '), line
  assert 'stop that job, or wait until its lease expires (60.0 s without renewal)' in line
  assert 'Traceback' not in second.stderr
  steps = [r['step'] for r in rows_before_kill if 'train/loss' in r]
  assert steps == list(range(1, len(steps) + 1))  # Only the first job's rows, once each.
  assert json.loads((workdir / lease.LEASE).read_text())['pid'] == first.pid  # Left by the kill.

  # The owner is gone (SIGKILL): a restart takes over at once, resumes and finishes.
  saved = max(int(s) for s in os.listdir(workdir / 'checkpoints') if s.isdigit())
  third = run_cli(*_args(workdir, saved + 4), '--log_libraries', timeout=120)
  assert third.returncode == 0, third.stderr[-3000:]
  assert ORBAX_INFO in third.stderr  # --log_libraries: orbax's INFO lines too.
  assert f'taking over {workdir} from host {socket.gethostname()} process {first.pid}' in third.stderr
  assert not (workdir / lease.LEASE).exists() and not (workdir / lease.LOCK).exists()
  steps = [r['step'] for r in read_metrics(workdir) if 'train/loss' in r]
  assert steps == list(range(1, saved + 5))


def _until(condition, what, timeout=30.0):
  """Returns once condition() is true (polled every 10 ms); fails after `timeout` s."""
  deadline = time.monotonic() + timeout
  while not condition():
    if time.monotonic() > deadline:
      pytest.fail(f'not within {timeout:.0f} s: {what}')
    time.sleep(0.01)


def test_a_live_owner_on_another_host_blocks_until_its_lease_expires(tmp_path):
  _write_lease(tmp_path)
  with pytest.raises(lease.WorkdirBusyError, match=r'owned by a live job \(host elsewhere, '
                     r'process 4242, started 2026-01-01T00:00:00\+00:00, renewed 0 s ago\)'):
    lease.Lease(str(tmp_path), 60.0).acquire()
  assert json.loads((tmp_path / lease.LEASE).read_text())['token'] == 'theirs'  # Untouched.
  _write_lease(tmp_path, renewed=time.time() - 61)  # Expired: taken over.
  owner = lease.Lease(str(tmp_path), 60.0)
  owner.acquire()
  assert json.loads((tmp_path / lease.LEASE).read_text())['pid'] == os.getpid()
  owner.release()
  assert os.listdir(tmp_path) == []


def test_renewal_keeps_the_lease_and_notices_a_takeover(tmp_path):
  owner = lease.Lease(str(tmp_path), 0.4)  # Renews every 0.1 s.
  owner.acquire()
  first = json.loads((tmp_path / lease.LEASE).read_text())['renewed']
  # Renewed more than a ttl after it was taken: without renewals it would have expired.
  _until(lambda: json.loads((tmp_path / lease.LEASE).read_text())['renewed'] > first + 0.4,
         'the lease renewed more than a ttl after it was taken')
  owner.check()
  _write_lease(tmp_path)  # Another job took over (say, after this one stalled past the ttl).
  _until(lambda: owner.lost, "the other job's lease noticed by the next renewal")
  with pytest.raises(lease.WorkdirBusyError, match=r'this run lost ownership \(host elsewhere '
                                                    r'process 4242 took it over\)'):
    owner.check()
  owner.release()
  assert json.loads((tmp_path / lease.LEASE).read_text())['token'] == 'theirs'  # Not ours to delete.


def test_a_run_whose_lease_is_taken_over_stops_before_its_next_save(tmp_path):
  """A real run renewing every 0.5 s; another job's lease replaces its own mid-run. The run
  notices, refuses its next save (that step is logged, not saved), exits 1 with one line,
  and leaves the new owner's lease alone."""
  workdir = tmp_path / 'run'
  with open(tmp_path / 'run.log', 'w+', encoding='utf-8') as log:
    run = _start(str(workdir), log, *_args(workdir, 100_000),
                 '--config.checkpoint.lease_seconds=2')
    try:
      _wait_for_step(str(workdir), run, 3)
      _write_lease(workdir)  # Live: renewed now, by host 'elsewhere'.
      rc = run.wait(timeout=30)  # It notices within 0.5 s.
    finally:
      if run.poll() is None:
        run.kill()
    log.seek(0)
    stderr = log.read()
  assert rc == 1, stderr[-3000:]
  assert stderr.strip().splitlines()[-1] == (
      f'zoo: error: --workdir: {workdir}: this run lost ownership (host elsewhere process 4242 '
      'took it over); stopped without saving, so as not to overwrite the new owner')
  assert json.loads((workdir / lease.LEASE).read_text())['token'] == 'theirs'
  last = max(r['step'] for r in read_metrics(workdir) if 'train/loss' in r)
  saved = max(int(s) for s in os.listdir(workdir / 'checkpoints') if s.isdigit())
  assert last % 2 == 0 and saved == last - 2, (last, saved)  # Logged the save step, no more.


@pytest.mark.parametrize('relative', [False, True])
def test_a_workdir_made_for_the_lease_is_removed_if_nothing_else_was_written(
    relative, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # A relative workdir (runs/x, as in the README) whose parents
  workdir = os.path.join('a', 'b') if relative else str(tmp_path / 'a' / 'b')  # are missing.
  owner = lease.Lease(workdir, 60.0)
  owner.acquire()
  assert (tmp_path / 'a' / 'b' / lease.LEASE).exists()
  owner.release()
  assert os.listdir(tmp_path) == []


def test_jobs_starting_together_have_one_winner(tmp_path):
  script = textwrap.dedent(f"""
      import sys, time
      sys.path.insert(0, {REPO!r})
      from zoo.store import lease
      owner = lease.Lease({str(tmp_path)!r}, 60.0)
      print('ready', flush=True)
      start = float(sys.stdin.readline())  # One instant for all, given once all are ready.
      time.sleep(max(0.0, start - time.time() - 0.02))
      while time.time() < start:  # Start together.
        pass
      try:
        owner.acquire()
      except lease.WorkdirBusyError:
        print('busy', flush=True)
        sys.exit(0)
      print('won', flush=True)
      sys.stdin.readline()  # Alive while the others try: until every one has answered.
      owner.release()
      """)
  procs = [subprocess.Popen([sys.executable, '-c', script], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True) for _ in range(4)]
  try:
    assert [p.stdout.readline() for p in procs] == ['ready\n'] * 4
    start = f'{time.time() + 0.2}\n'
    for p in procs:
      p.stdin.write(start)
      p.stdin.flush()
    outputs = sorted(p.stdout.readline().strip() for p in procs)  # The winner holds on.
    for p in procs:
      p.stdin.close()  # Now the winner releases.
      assert p.wait(timeout=60) == 0
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  assert outputs == ['busy', 'busy', 'busy', 'won']
  assert os.listdir(tmp_path) == []


_STALLING = """
import sys, threading, time
sys.path.insert(0, {repo!r})
from zoo.store import lease
owner = lease.Lease({workdir!r}, 1.0)
owner.acquire()
print('held', flush=True)
never = threading.Event()
lease.Lease._write = lambda self: never.wait()  # The storage stops answering.
time.sleep(60)  # The main thread is stuck too (in a save, say): nothing here ends it.
print('not ended', flush=True)
"""


def test_a_lease_the_storage_stops_taking_ends_the_process_within_its_ttl(tmp_path):
  """Renewals hang and so does the main thread: the watcher ends the process one ttl after
  the last renewal, with one line naming the workdir, and no cleanup runs."""
  script = _STALLING.format(repo=REPO, workdir=str(tmp_path))
  t0 = time.monotonic()
  run = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True,
                       timeout=60, check=False)
  took = time.monotonic() - t0
  assert run.returncode == 1, run.stderr[-3000:]
  assert run.stdout == 'held\n'
  assert run.stderr.strip().splitlines()[-1] == (
      f'zoo: error: --workdir: {tmp_path}: could not renew the lease for 1 s (the storage did '
      'not answer); stopped at once, since another job may now take the workdir. The newest '
      'complete checkpoint is kept: run the same command again once the storage answers')
  assert took < 20, took  # Python's start and zoo's imports, then 1-2 s.


def test_renewal_errors_name_their_cause_and_release_is_bounded(tmp_path, monkeypatch):
  monkeypatch.setattr(lease.Lease, '_watch', lambda self: None)  # (Else it would end this
  owner = lease.Lease(str(tmp_path), 0.4)  # process, as above.) Renews every 0.1 s.
  owner.acquire()
  def refused(self):
    raise PermissionError(13, 'Permission denied')
  monkeypatch.setattr(lease.Lease, '_write', refused)
  _until(lambda: owner._trouble, 'a failed renewal recorded')  # pylint: disable=protected-access
  assert owner._trouble == 'PermissionError: [Errno 13] Permission denied'  # pylint: disable=protected-access
  never = threading.Event()
  monkeypatch.setattr(lease.Lease, '_remove_if_ours', lambda self: never.wait(5))
  monkeypatch.setattr(lease, 'RELEASE_SECONDS', 0.5)
  t0 = time.monotonic()
  owner.release()  # Deleting hangs: abandoned after RELEASE_SECONDS.
  assert time.monotonic() - t0 < 2
  never.set()
