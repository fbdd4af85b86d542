"""A save that fails on real storage (a full filesystem): one line, nothing lost, resumable."""
import contextlib
import json
import os
import subprocess
import sys
import time

import pytest

from conftest import REPO, cli_env, experiment, read_metrics, run_cli

ORBAX_INFO = 'No errors found in background save thread'  # Orbax logs it per async save.


@contextlib.contextmanager
def _small_filesystem(path, size):
  """A size-limited tmpfs at `path` (needs root, as in CI); skips the test where there is none."""
  os.makedirs(path)
  mounted = subprocess.run(['mount', '-t', 'tmpfs', '-o', f'size={size}', 'tmpfs', str(path)],
                           capture_output=True, check=False, timeout=30).returncode == 0
  if not mounted:
    pytest.skip('cannot mount a tmpfs here (not root)')
  try:
    yield
  finally:
    subprocess.run(['umount', '-l', str(path)], check=False, timeout=30)


# A constant learning rate (after the warmup) in every run here: the compiled programs do
# not depend on train.steps, so runs of different lengths share them (one compile).
CONSTANT = '--config.optimizer.schedule=constant'


def _args(workdir, steps):
  return [f'--config={experiment("mlp_digits")}:smoke', f'--workdir={workdir}',
          f'--config.train.steps={steps}', '--config.train.log_every_steps=1',
          f'--config.eval.every_steps={steps}', '--config.checkpoint.every_steps=2', CONSTANT]


def _fill(path, leave):
  """Writes a file that leaves `leave` bytes free on path's filesystem."""
  stat = os.statvfs(path)
  with open(os.path.join(path, 'filler'), 'wb') as f:
    f.write(b'\0' * max(stat.f_bavail * stat.f_frsize - leave, 0))


def test_disk_full_during_a_save_names_step_path_cause_and_loses_nothing(tmp_path):
  fs = tmp_path / 'fs'
  workdir = fs / 'run'
  with _small_filesystem(fs, '16m'):
    first = run_cli(*_args(workdir, 4), timeout=180)
    assert first.returncode == 0, first.stderr[-3000:]
    # The console: zoo's lines, not orbax's INFO lines (--log_libraries shows them: lease_test).
    for line in ('saving checkpoint step 2 to ', 'step 4/4  loss ', 'eval at step 4: '):
      assert line in first.stderr
    assert ORBAX_INFO not in first.stderr
    checkpoints = workdir / 'checkpoints'
    step_bytes = sum(f.stat().st_size for f in (checkpoints / '4').rglob('*') if f.is_file())
    _fill(fs, step_bytes // 4)  # Room for metrics rows, not for a step.

    t0 = time.monotonic()
    full = run_cli(*_args(workdir, 8), timeout=180)
    took = time.monotonic() - t0
    assert full.returncode != 0
    assert took < 60, took  # Start-up, 2 steps, a save that fails, a bounded close.
    assert 'Traceback' not in full.stderr, full.stderr[-3000:]
    line = full.stderr.strip().splitlines()[-1]
    assert line.startswith(f'zoo: error: saving checkpoint step 6 to {checkpoints} failed ('), line
    assert 'failed (RESOURCE_EXHAUSTED: No space left on device); removed its partial files' in line
    assert line.endswith('earlier checkpoints and metrics.jsonl are intact (the next run resumes '
                         'from step 4). Free space or fix access to the storage, then run again'), line
    assert sorted(os.listdir(checkpoints)) == ['2', '4']  # No partial step 6 left behind.
    steps = [r['step'] for r in read_metrics(workdir) if 'train/loss' in r]  # Every line parses.
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 6
    assert not (workdir / 'lease.json').exists()  # Released on the way out.

    os.remove(fs / 'filler')
    again = run_cli(*_args(workdir, 8), timeout=180)
    assert again.returncode == 0, again.stderr[-3000:]
    assert 'resuming from step 4' in again.stderr
    assert [r['step'] for r in read_metrics(workdir) if 'train/loss' in r] == list(range(1, 9))
    assert json.loads((workdir / 'config.json').read_text())['train']['steps'] == 8


_QUOTA = """
import errno, runpy, sys
from zoo.store import storage
real = storage.write_text
def write_text(p, text):  # The quota runs out as the run writes its config.
  if str(p).endswith('/config.json'):
    raise OSError(errno.EDQUOT, 'Disk quota exceeded', str(p))
  return real(p, text)
storage.write_text = write_text
sys.argv = ['zoo.main'] + sys.argv[1:]
runpy.run_module('zoo.main', run_name='__main__')
"""


def test_a_quota_exceeded_is_one_line_and_frees_the_workdir(tmp_path):
  """EDQUOT (a user or project quota) takes the full disk's way: one line naming the file
  and the fix, exit 1, the lease released. This kernel's tmpfs has no quotas, so the error
  is raised where the storage would raise it, writing the run's config.json."""
  workdir = tmp_path / 'run'
  env = cli_env()
  result = subprocess.run([sys.executable, '-c', _QUOTA, '--cpu_devices=2', *_args(workdir, 4)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
                          check=False)
  assert result.returncode == 1 and 'Traceback' not in result.stderr, result.stderr[-3000:]
  assert result.stderr.strip().splitlines()[-1] == (
      f'zoo: error: {workdir}/config.json: Disk quota exceeded; free space (quota), then run '
      'the same command again')
  assert not (workdir / 'lease.json').exists()


def _lm_args(workdir, steps=400):
  return [f'--config={experiment("char_lm")}:smoke', f'--workdir={workdir}',
          f'--config.train.steps={steps}', '--config.train.log_every_steps=1',
          '--config.checkpoint.every_steps=1000', CONSTANT]


# while-logging: room for the start-up's files (~20 kB on tmpfs's 4 kB pages) and some 20
# steps' rows, so the disk fills in the loop; at-the-start: not even for the lease.
@pytest.mark.parametrize('leave', [40_000, 1_000], ids=['while-logging', 'at-the-start'])
def test_full_disk_while_logging_ends_in_one_line_within_seconds(tmp_path, leave):
  """tensorboardX's writer thread dies on ENOSPC, after which its every call and its close
  block for good; the run must still end in one line, release the lease and resume."""
  fs = tmp_path / 'fs'
  workdir = fs / 'run'
  with _small_filesystem(fs, '3m'):
    _fill(fs, leave)
    t0 = time.monotonic()
    full = run_cli(*_lm_args(workdir), devices=2, timeout=120)
    took = time.monotonic() - t0
    assert full.returncode == 1, full.stderr[-3000:]
    if leave > 1_000:  # The disk filled while the loop logged, not before it.
      assert 'step 1/400  loss ' in full.stderr, full.stderr[-3000:]
    assert 'Traceback' not in full.stderr, full.stderr[-3000:]
    line = full.stderr.strip().splitlines()[-1]
    assert line.startswith(f'zoo: error: {workdir}'), line
    assert line.endswith('No space left on device; free space, then run the same command again')
    assert took < 60, took  # Start-up, training until the disk fills, a bounded close.
    assert not (workdir / 'lease.json').exists()  # Released: a restart may take the workdir.

    os.remove(fs / 'filler')
    again = run_cli(*_lm_args(workdir, steps=20), devices=2, timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [r['step'] for r in read_metrics(workdir) if 'train/loss' in r] == list(range(1, 21))


@contextlib.contextmanager
def _ext4(path, size_mb=64):
  """An ext4 filesystem on a loop device at `path`, mounted errors=remount-ro; yields
  (fail, mend): fail() makes it read-only as a failing disk does (ext4's emergency
  remount: every write fails, open files included), mend() checks and mounts it again.
  Needs root and loop devices; skips otherwise."""
  image = f'{path}.img'
  os.makedirs(path)
  made = subprocess.run(f'truncate -s {size_mb}M {image} && mkfs.ext4 -q -F {image} && '
                        f'mount -o loop,errors=remount-ro {image} {path}', shell=True,
                        capture_output=True, check=False, timeout=60).returncode == 0
  if not made:
    pytest.skip('cannot mount an ext4 loop device here (not root, or no loop devices)')
  with open('/proc/mounts', encoding='utf-8') as mounts:
    device = os.path.basename(next(line.split()[0] for line in mounts
                                   if line.split()[1] == str(path)))
  def fail():
    with open(f'/sys/fs/ext4/{device}/trigger_fs_error', 'w', encoding='utf-8') as f:
      f.write('zoo test: the disk fails\n')
  def mend():
    subprocess.run(f'umount {path} && e2fsck -fy {image} >/dev/null; mount -o loop {image} {path}',
                   shell=True, check=True, timeout=60)
  try:
    yield fail, mend
  finally:
    subprocess.run(['umount', '-l', str(path)], check=False, timeout=30)
    os.remove(image)


def test_storage_turning_read_only_mid_run_ends_in_one_line_and_resumes(tmp_path):
  """The workdir's disk goes read-only while the run trains, logs and saves: the run ends
  within seconds in one line naming the storage, and, the disk mended, resumes from the
  newest complete checkpoint with every step logged once."""
  fs = tmp_path / 'fs'
  workdir = fs / 'run'
  args = [f'--config={experiment("char_lm")}:smoke', f'--workdir={workdir}',
          '--config.train.steps=100000', '--config.train.log_every_steps=1',
          '--config.eval.every_steps=100000', '--config.checkpoint.every_steps=10', CONSTANT]
  env = cli_env()
  def logged():
    try:
      return len(read_metrics(workdir))
    except (FileNotFoundError, ValueError):
      return 0
  with _ext4(fs) as (fail, mend):
    run = subprocess.Popen([sys.executable, '-m', 'zoo.main', '--cpu_devices=2', *args],
                           env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    try:
      # The disk fails between saves: step 30 saved, steps after it being logged. (A step
      # renamed into place is fsync'd at once; the test stays clear of those milliseconds.)
      deadline = time.monotonic() + 120
      while not ((workdir / 'checkpoints' / '30').exists() and logged() >= 33):
        assert run.poll() is None and time.monotonic() < deadline, run.stderr.read()[-3000:]
        time.sleep(0.01)
      fail()
      t0 = time.monotonic()
      _, stderr = run.communicate(timeout=60)
      took = time.monotonic() - t0
    finally:
      run.kill()
    assert run.returncode == 1, stderr[-3000:]
    assert 'Traceback' not in stderr, stderr[-3000:]
    line = stderr.strip().splitlines()[-1]
    assert line.startswith('zoo: error: ') and 'Read-only file system' in line, stderr[-4000:]
    assert str(workdir) in line, line
    assert took < 30, took
    # The disk mended (fsck, mounted again): the newest complete step resumes, and no
    # step is logged twice or missing.
    mend()
    saved = sorted(int(s) for s in os.listdir(workdir / 'checkpoints') if s.isdigit())
    again = run_cli(*args[:2], f'--config.train.steps={saved[-1] + 10}', *args[3:], devices=2,
                    timeout=180)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f'resuming from step {saved[-1]}' in again.stderr
    steps = [r['step'] for r in read_metrics(workdir) if 'train/loss' in r]
    assert steps == list(range(1, saved[-1] + 11)), steps
