"""The train loop waits on the devices only to log, evaluate or save; batches are prefetched."""
import functools
import os
import threading
import time
import types

import jax
import numpy as np
import pytest

from conftest import load_config, read_metrics, trainer
from zoo.data import feed
from zoo.errors import NonFiniteError
from zoo.run import setup as setup_lib
from zoo.run import steps, train


def test_prefetch_yields_batches_in_order_from_another_thread():
  threads = []

  def make(step):
    threads.append(threading.current_thread().name)
    return {'x': np.full((2,), step)}
  batches = feed.Prefetch(make, 3, 9, depth=2)
  assert [int(batches.get(s)['x'][0]) for s in range(3, 9)] == list(range(3, 9))
  batches.close()
  assert set(threads) == {'zoo-prefetch'}
  inline = feed.Prefetch(make, 0, 2, depth=0)
  assert int(inline.get(1)['x'][0]) == 1 and threads[-1] == threading.current_thread().name


def test_prefetch_reraises_the_threads_error_and_close_stops_it():
  def make(step):
    if step == 2:
      raise ValueError('bad file at step 2')
    return step
  batches = feed.Prefetch(make, 0, 5, depth=3)
  assert [batches.get(0), batches.get(1)] == [0, 1]
  with pytest.raises(ValueError, match='bad file at step 2'):
    batches.get(2)
  endless = feed.Prefetch(lambda step: step, 0, 10**9, depth=2)
  endless.get(0)
  endless.close()
  assert not endless._thread.is_alive()  # pylint: disable=protected-access


def test_metrics_are_fetched_only_at_log_steps(tmp_path, devices, monkeypatch):
  """40 steps, logging every 10: the loop fetches 4 steps' metrics, not 40."""
  del devices
  fetched = []
  original = train.fetch

  def counting_fetch(x):
    fetched.append(x)
    return original(x)
  monkeypatch.setattr(train, 'fetch', counting_fetch)
  config = load_config('mlp_digits', **{'train.steps': 40, 'train.log_every_steps': 10,
                                        'eval.every_steps': 40, 'checkpoint.every_steps': 40})
  train.train_and_evaluate(config, str(tmp_path))
  assert len(fetched) == 4
  assert [r['step'] for r in read_metrics(tmp_path) if 'train/loss' in r] == [10, 20, 30, 40]


def test_the_step_time_counts_every_step(tmp_path, devices, monkeypatch):
  """perf/step_time_s is the devices' time per step. Each step here sleeps 0.2 s on the
  devices (a host callback inside the step, which stamps the time it runs); the logged
  time per step between two rows equals the stamps' spacing over the same steps. Broken
  before 2026-11-27 (cac21fd): the reporter read the learning rate eagerly between reading
  the clock and restarting it, and that read waited for the step already dispatched, so a
  row left one step of its interval out: 4/5 of the time at log_every_steps=5, what issue
  56 measured as a 25% step regression on a GPU."""
  del devices
  stamps, original = {}, steps.train_step

  def stamp(step):
    time.sleep(0.2)
    stamps[int(step)] = time.perf_counter()
    return np.float32(0)

  def slow_step(state, batch, **kwargs):
    state, metrics = original(state, batch, **kwargs)
    slept = jax.pure_callback(stamp, jax.ShapeDtypeStruct((), np.float32), state.step)
    return state, {**metrics, 'train/loss': metrics['train/loss'] + slept}
  monkeypatch.setattr(steps, 'train_step', slow_step)
  config = load_config('char_lm', **{'train.steps': 20, 'train.log_every_steps': 5,
                                     'eval.every_steps': 20, 'checkpoint.every_steps': 20})
  train.train_and_evaluate(config, str(tmp_path))
  logged = {r['step']: r['perf/step_time_s'] for r in read_metrics(tmp_path)
            if 'perf/step_time_s' in r}
  assert sorted(logged) == [5, 10, 15, 20]
  for step in (10, 15):  # Rows after the first, before the last step's eval.
    devices_time = (stamps[step] - stamps[step - 5]) / 5
    assert logged[step] == pytest.approx(devices_time, rel=0.08), (step, logged, devices_time)


def test_state_check_finds_a_non_finite_optimizer_state(devices):
  """Adam's moments can overflow while the parameters stay finite (with an infinite second
  moment the update is 0): the check before a save looks at everything the checkpoint
  holds."""
  del devices
  t = trainer('mlp_digits')
  with t.scope():
    good = steps.check_state(t.initial)
    assert bool(good['state_finite']) and np.isfinite(float(good['train/param_norm']))
    leaves, tree = jax.tree.flatten(t.initial.opt_state)
    index = max(range(len(leaves)), key=lambda i: leaves[i].size)  # A moment, not the count.
    leaves[index] = leaves[index].at[(0,) * leaves[index].ndim].set(np.inf)
    bad = steps.check_state(t.initial.replace(opt_state=jax.tree.unflatten(tree, leaves)))
  assert not bool(bad['state_finite'])
  assert float(bad['train/param_norm']) == float(good['train/param_norm'])


def test_a_non_finite_optimizer_state_stops_the_run_before_it_is_saved(tmp_path, devices,
                                                                      monkeypatch):
  """The loop acts on check_state: here it reports a non-finite state from step 10 on."""
  del devices
  real = steps.check_state

  def broken_from_step_10(state):
    checked = real(state)
    return {**checked, 'state_finite': checked['state_finite'] & (state.step < 10)}
  monkeypatch.setattr(steps, 'check_state', broken_from_step_10)
  config = load_config('mlp_digits', **{'train.steps': 40, 'train.log_every_steps': 5,
                                        'eval.every_steps': 40, 'checkpoint.every_steps': 5})
  with pytest.raises(NonFiniteError, match='non-finite optimizer or model state at step 10;'):
    train.train_and_evaluate(config, str(tmp_path))
  assert sorted(int(s) for s in os.listdir(tmp_path / 'checkpoints') if s.isdigit()) == [5]


def test_prefetch_after_close_raises_instead_of_waiting_forever():
  batches = feed.Prefetch(lambda step: step, 0, 100, depth=2)
  batches.get(0)
  batches.close()
  with pytest.raises(RuntimeError, match='the prefetch thread stopped before step'):
    for step in range(1, 100):  # What was queued before the close, then the error.
      batches.get(step)


def test_a_programs_first_run_has_the_devices_to_itself(tmp_path, devices, monkeypatch):
  """The prefetch thread builds and copies no batch while the train, check and eval steps
  run for the first time (XLA captures cuDNN graphs then; a copy from the thread broke the
  capture on an H100), and prefetches as before otherwise: events of a char_lm run with a
  slowed first step, in order."""
  del devices
  events, lock = [], threading.Lock()

  def log(what):
    with lock:
      events.append((what, threading.current_thread().name))
  make = feed.TrainBatches.__call__

  def logged_make(self, step):
    log(f'make {step}')
    time.sleep(0.05)  # The thread is still making batches when the first step starts.
    return make(self, step)
  monkeypatch.setattr(feed.TrainBatches, '__call__', logged_make)
  compile_steps = train.compile_steps

  def logged_compile(setup, state):
    *fns, cost = compile_steps(setup, state)

    def logged(name, fn):
      def call(*args):
        log(f'{name} start')
        out = jax.block_until_ready(fn(*args))
        if name == 'train' and not any(e[0] == 'train end' for e in events):
          time.sleep(0.5)  # Without the pause the thread would make batches meanwhile.
        log(f'{name} end')
        return out
      return call
    return (*(logged(n, f) for n, f in zip(('train', 'check', 'eval'), fns)), cost)
  monkeypatch.setattr(train, 'compile_steps', logged_compile)
  config = load_config('char_lm', **{'train.steps': 12, 'eval.every_steps': 6,
                                     'checkpoint.every_steps': 100, 'data.prefetch': 4})
  train.train_and_evaluate(config, str(tmp_path / 'run'))
  names = [e for e, _ in events]
  for step in ('train', 'check', 'eval'):
    first, end = names.index(f'{step} start'), names.index(f'{step} end')
    assert not [e for e in names[first:end] if e.startswith('make')], (step, names[first:end])
  made = [t for e, t in events if e.startswith('make')]
  assert made == ['zoo-prefetch'] * 12  # Every batch on the thread, none given up.


def test_each_new_program_runs_alone_at_first():
  """A step called with a batch of new shapes (the eval and scoring steps compile a program
  per shape) runs inside quiet() once more; repeated shapes run as dispatched."""
  entered = []

  class Quiet:
    def __enter__(self):
      entered.append(1)

    def __exit__(self, *exc):
      return False
  step = train.alone_at_first(lambda state, batch: batch['x'] + state, Quiet)
  for rows in (4, 4, 8, 4, 8):
    step(np.float32(1), {'x': np.zeros(rows, np.float32)})
  assert len(entered) == 2


def test_a_second_run_of_the_same_build_lowers_nothing_and_another_config_its_own(
    tmp_path, devices):
  """Running a config again in the same process (a resume, a notebook's next call) reuses
  the first run's programs (setup.build keeps them): nothing is lowered again, and the same
  figures come out. A config that differs in anything (here the learning rate, which the
  train step computes) gets programs of its own: it trains at its own rate."""
  del devices
  lowered = []
  listen = lambda event, secs, **kw: lowered.append(event) if 'mlir_module' in event else None
  jax.monitoring.register_event_duration_secs_listener(listen)
  figures = lambda run: [{k: v for k, v in r.items() if not k.startswith('perf/')}
                         for r in read_metrics(tmp_path / run)]
  try:
    config = load_config('char_lm', **{'train.steps': 4, 'eval.every_steps': 4,
                                       'train.log_every_steps': 2, 'optimizer.warmup_steps': 0,
                                       'optimizer.schedule': 'constant'})
    train.train_and_evaluate(config, str(tmp_path / 'first'))
    del lowered[:]
    train.train_and_evaluate(config, str(tmp_path / 'again'))
    assert not lowered
    assert figures('again') == figures('first')
    config.optimizer.learning_rate *= 2
    train.train_and_evaluate(config, str(tmp_path / 'faster'))
    assert lowered
    rates = {r['train/learning_rate'] for r in read_metrics(tmp_path / 'faster')
             if 'train/learning_rate' in r}
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  assert len(rates) == 1 and rates.pop() == pytest.approx(config.optimizer.learning_rate)


def test_setup_jit_keeps_one_program_per_function_and_bound_values():
  """Setup.jit's key: the function, numbers, strings and shardings by value, bound methods
  by their object, anything else by identity."""
  holder = types.SimpleNamespace(programs={})
  jit = functools.partial(setup_lib.Setup.jit, holder)
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  first = jit(np.add, 1, out_shardings=sharding)
  assert jit(np.add, 1, out_shardings=jax.sharding.SingleDeviceSharding(jax.devices()[0])) is first
  assert jit(np.add, 2, out_shardings=sharding) is not first
  assert jit(np.add, 1.0, out_shardings=sharding) is not first  # Equal to 1, not the same.
  assert jit(np.add, True, out_shardings=sharding) is not first
  assert jit(np.subtract, 1, out_shardings=sharding) is not first
  assert jit(np.add, 1) is not first

  class Model:
    def apply(self, x):
      return x
  one, other = Model(), Model()
  assert jit(steps.score_step, apply_fn=one.apply) is jit(steps.score_step, apply_fn=one.apply)
  assert jit(steps.score_step, apply_fn=one.apply) is not jit(steps.score_step,
                                                              apply_fn=other.apply)
  table = [1]
  assert jit(np.add, table) is not jit(np.add, [1])  # A list: by identity.
