"""Real `python -m zoo.main` processes killed with SIGKILL or SIGTERM, then resumed."""
import glob
import os
import random
import re
import signal
import subprocess
import sys
import time
import types

import pytest

from conftest import REPO, cli_env, experiment, load_config, read_metrics, run_cli
from zoo.run import train

STEPS = 40
FLAGS = {'train.steps': STEPS, 'train.log_every_steps': 1, 'eval.every_steps': STEPS,
         'checkpoint.every_steps': 2, 'mesh.shape': (4, 2)}  # A save every other step.


def _args(workdir, **overrides):
  return [f'--config={experiment("mlp_digits")}:smoke', f'--workdir={workdir}',
          *(f'--config.{k}={v}'.replace(' ', '') for k, v in {**FLAGS, **overrides}.items())]


def _start(workdir, log, *extra):
  env = cli_env()
  return subprocess.Popen([sys.executable, '-m', 'zoo.main', '--cpu_devices=8', *extra],
                          cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log)


def _wait_for_step(workdir, proc, step, timeout=120):
  """Returns once the run has logged `step` (it logs every step)."""
  deadline = time.time() + timeout
  path = os.path.join(workdir, 'metrics.jsonl')
  while time.time() < deadline:
    assert proc.poll() is None, 'the run ended before it could be interrupted'
    if os.path.exists(path):
      with open(path, encoding='utf-8') as f:
        if sum(line.endswith('\n') for line in f) >= step:
          return
    time.sleep(0.005)
  raise TimeoutError(f'step {step} was not reached')


def _train_losses(workdir):
  rows = [r for r in read_metrics(workdir) if 'train/loss' in r]
  steps = [r['step'] for r in rows]
  assert len(steps) == len(set(steps)), 'a step was logged twice'
  return {r['step']: r['train/loss'] for r in rows}


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
  """(losses, final eval row) of the run that never died. It saves once, at the end: how
  often a run saves changes nothing it computes."""
  workdir = str(tmp_path_factory.mktemp('reference'))
  train.train_and_evaluate(load_config('mlp_digits', **{**FLAGS, 'checkpoint.every_steps': STEPS}),
                           workdir)
  return _train_losses(workdir), read_metrics(workdir)[-1]


def test_sigkill_at_a_random_moment_then_resume(reference, tmp_path):
  """A new random moment each run (its seed is printed and in every failure message)."""
  seed = random.SystemRandom().randrange(2**32)
  workdir = str(tmp_path / 'run')
  with open(tmp_path / 'killed.log', 'w', encoding='utf-8') as log:
    proc = _start(workdir, log, *_args(workdir))
    # A random step, then a random instant within it: with a save every other step, kills
    # land in and between saves (the trials so far left N.orbax-checkpoint-tmp behind).
    rng = random.Random(seed)
    step, delay = rng.randint(1, STEPS // 2), rng.uniform(0.0, 0.05)
    _wait_for_step(workdir, proc, step)
    time.sleep(delay)
    assert proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
  killed_at = max(_train_losses(workdir))
  moment = (f'seed {seed}: killed {delay * 1e3:.1f} ms after step {step} was logged, after '
            f'step {killed_at}; checkpoints '
            f'{sorted(os.listdir(os.path.join(workdir, "checkpoints")))}')
  print(moment)
  assert killed_at < STEPS, f'the kill came too late to test anything ({moment})'

  result = run_cli(*_args(workdir))
  assert result.returncode == 0, f'{moment}\n{result.stderr[-3000:]}'
  # A kill during the first save leaves no complete step: the restart says so and starts over.
  assert ('resuming from step' in result.stderr
          or 'no complete checkpoint in' in result.stderr), moment
  losses, final_eval = _train_losses(workdir), read_metrics(workdir)[-1]
  # Every step once, bit-identical to the run that never died.
  assert losses == reference[0], moment
  assert final_eval == reference[1], moment
  assert not glob.glob(os.path.join(workdir, 'checkpoints', '*tmp*')), \
      f'temporary dirs remain ({moment})'


# The run stopped by SIGTERM: SIGTERM comes after step 4 or so, long before its end (the
# margin keeps a busy machine from finishing the run before the signal lands).
STOPPED_RUN = {'train.steps': STEPS, 'eval.every_steps': 2}


@pytest.fixture(scope='module')
def stopped(tmp_path_factory):
  """A run with a fresh --compilation_cache_dir, evaluating every other step, sent SIGTERM
  once it has trained and evaluated: what the SIGTERM test checks of how it stopped (taken
  at once, before the cache test restarts it), and the arguments to restart it."""
  root = tmp_path_factory.mktemp('stopped')
  workdir = str(root / 'run')
  args = [*_args(workdir, **STOPPED_RUN), f'--compilation_cache_dir={root / "cache"}']
  with open(root / 'first.log', 'w+', encoding='utf-8') as log:
    proc = _start(workdir, log, *args)
    _wait_for_step(workdir, proc, 5)  # Rows of steps 1, 2 and the eval at 2 (+ margin).
    sent = time.time()
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=60)
    elapsed = time.time() - sent
    log.seek(0)
    stderr = log.read()
  return types.SimpleNamespace(
      args=args, rc=rc, elapsed=elapsed, stderr=stderr, last_logged=max(_train_losses(workdir)),
      saved=sorted(int(s) for s in os.listdir(os.path.join(workdir, 'checkpoints'))
                   if s.isdigit()))


def test_sigterm_saves_the_current_step_and_exits_zero(stopped):
  assert stopped.rc == 0, stopped.stderr[-3000:]
  assert stopped.elapsed < 10, f'took {stopped.elapsed:.1f} s to stop'
  last_logged, saved = stopped.last_logged, stopped.saved
  assert last_logged < STOPPED_RUN['train.steps'] and saved[-1] == last_logged
  assert f'stop requested (SIGTERM or preemption) at step {last_logged}' in stopped.stderr


def test_restart_with_a_warm_compilation_cache_compiles_nothing(stopped):
  """Stopped by SIGTERM after it has trained and evaluated, then restarted: every program
  (init, train and eval steps, the rest) comes from --compilation_cache_dir."""
  args, first = stopped.args, stopped.stderr
  assert stopped.rc == 0, first[-3000:]
  assert re.search(r'XLA compilation cache: 0 programs loaded from the cache, [1-9]\d* compiled',
                   first), first[-2000:]
  result = run_cli(*args)
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'resuming from step' in result.stderr
  loaded = re.search(r'XLA compilation cache: (\d+) programs loaded from the cache, 0 compiled',
                     result.stderr)
  assert loaded and int(loaded.group(1)) > 0, result.stderr[-2000:]
