"""The training loop: validate -> setup -> state -> compile -> dispatch, report, save, evaluate."""
import collections
import contextlib
import time
from typing import Any, Callable, Optional

from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from zoo.data import choice, feed
from zoo.models import quantize
from zoo.errors import NonFiniteError
from zoo.parallel import sharding
from zoo.run import config as cfg
from zoo.run import chunks, memory, perf, profiling, reference, rollouts, steps
from zoo.run import setup as setup_lib
from zoo.store import checkpoint, metrics
from zoo.store.workdir import Workdir

# Steps the loop may dispatch beyond the newest one the devices finished: enough to keep
# them busy, few enough that a stop request (SIGTERM) is served within a few steps and
# that few batches wait on the devices.
MAX_STEPS_AHEAD = 2


def is_due(step: int, every: int, last: int) -> bool:
  """Whether a periodic action (log, eval, save) runs after `step`: every `every` steps
  and after the `last`."""
  return step % every == 0 or step == last


def fetch(tree: Any) -> Any:
  """The loop's only transfer from the devices between logs, evals and saves."""
  return jax.device_get(tree)


class Reporter:
  """Turns the devices' metrics into checks and rows: fetches a step's metrics, stops the
  run on a non-finite value, and at log steps writes them with throughput, MFU and ETA.

  A step that is only logged has its metrics fetched after the next step is dispatched
  (`defer`, then `flush`), so the host never stalls the devices to log; eval and save steps
  are checked at once. Step time is measured since the previous logged row or eval.
  """

  def __init__(self, setup: setup_lib.Setup, writer: metrics.MetricWriter, cost: dict,
               start_step: int):
    self.setup, self.writer, self.cost = setup, writer, cost
    self.sampler = setup.task.eval_sampler(
        setup.model, setup.dataset, setup.mesh, setup.config.seed,
        setup.config.eval.sample_temperature, setup.jit) if setup.config.eval.sample else None
    self.pending: Optional[tuple] = None
    self.clock_time, self.clock_step, self.data_wait = time.perf_counter(), start_step, 0.0

  def restart_clock(self, step: int) -> None:
    self.clock_time, self.clock_step, self.data_wait = time.perf_counter(), step, 0.0

  def timed_wait(self, get_batch: Callable[[int], dict], step: int) -> dict:
    """get_batch(step), adding the time the loop waited for it to perf/data_wait_s."""
    t0 = time.perf_counter()
    batch = get_batch(step)
    self.data_wait += time.perf_counter() - t0
    return batch

  def defer(self, step: int, step_metrics: dict, check: dict) -> None:
    self.pending = (step, step_metrics, check)

  def flush(self) -> None:
    if self.pending:
      pending, self.pending = self.pending, None
      self.report(*pending)

  def report(self, step: int, step_metrics: dict, check: dict) -> None:
    """Checks that the loss, the parameter norm and the state (check_state) are finite, and
    at a log step writes the metrics. A non-finite value is found at the first logged,
    evaluated or saved step after it happened, before that state is saved."""
    scalars, check = fetch((step_metrics, check))
    scalars['train/param_norm'] = check['train/param_norm']
    for name in ('train/loss', 'train/param_norm'):
      if not np.isfinite(scalars[name]):
        raise NonFiniteError(
            f'non-finite {name} {scalars[name]} at step {step}; nothing was checkpointed after '
            'it. Lower optimizer.learning_rate or enable optimizer.grad_clip_norm')
    if not check['state_finite']:
      raise NonFiniteError(
          f'non-finite optimizer or model state at step {step}; nothing was checkpointed after '
          'it. Lower optimizer.learning_rate or enable optimizer.grad_clip_norm')
    train = self.setup.config.train
    if not is_due(step, train.log_every_steps, train.steps):
      return
    steps_timed = max(step - self.clock_step, 1)
    step_time = (time.perf_counter() - self.clock_time) / steps_timed
    cost = self.cost
    scalars.update({'perf/step_time_s': step_time,
                    'perf/data_wait_s': self.data_wait / steps_timed,
                    'perf/examples_per_s': train.batch_size / step_time,
                    'perf/flops_per_step': cost['model_flops']})
    if 'tokens' in cost:
      scalars['perf/tokens_per_s'] = cost['tokens'] / step_time
    if cost['peak_flops_per_device']:
      scalars['perf/mfu'] = perf.mfu(cost['model_flops'], step_time, cost['devices'],
                                     cost['peak_flops_per_device'])
    self.writer.write(step, scalars)
    metrics.log_progress(step, train.steps, scalars, step_time * (train.steps - step))
    self.restart_clock(step)

  def evaluated(self, step: int, result: dict, params: Any) -> None:
    """Writes an eval's metrics, then what the task shows besides them (the LM's sample)."""
    self.writer.write(step, result)
    logging.info('eval at step %d: %s', step, '  '.join(f'{k} {v:.4f}' for k, v in result.items()))
    if self.sampler:
      self.sampler(params, step, self.writer)
    self.restart_clock(step)


def alone_at_first(fn: Callable, quiet: Callable) -> Callable:
  """`fn` (a step) whose first call with each new set of argument shapes (a new program: the
  eval and scoring steps compile one per shape) runs with the devices to itself: `quiet()`
  (the prefetch thread copies nothing) is held until its outputs are ready. XLA captures
  cuDNN's graphs on a program's first execution, and a host-to-device copy from another
  thread in the meantime is what the crash on an H100 with cuDNN attention on packed
  documents points at ('cuda_graph_end_capture ... capturing stream has unjoined work' at
  the first step); later calls run as dispatched."""
  seen = set()

  def call(*args):
    shapes = tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(args[1:]))  # The batch's.
    if shapes in seen:
      return fn(*args)
    seen.add(shapes)
    with quiet():
      return jax.block_until_ready(fn(*args))
  return call


def evaluate(eval_step: Callable, state: steps.TrainState, setup: setup_lib.Setup,
             choice_step: Optional[Callable] = None) -> dict:
  """The task's metrics over the eval split (or its first eval.max_batches batches); for
  a dataset in parts (a mixture's sources), over each part (`eval/<part>/...`, its first
  eval.max_batches) and over all of them together (`eval/...`); then, with `choice_step`
  (Setup.jit_score_step), each multiple-choice task's `eval/<task>/acc` and `acc_norm`."""
  dataset, config = setup.dataset, setup.config
  parts = dataset.eval_sources or {'': dataset.eval_batches}
  result, total = {}, None
  for name, batches in parts.items():
    sums = None
    for batch in feed.eval_batches(batches, setup.placement, config.eval.batch_size,
                                   config.eval.max_batches, setup.arrange):
      out = eval_step(state, batch)
      sums = out if sums is None else jax.tree.map(jnp.add, sums, out)
    sums = jax.device_get(sums)
    total = sums if total is None else jax.tree.map(np.add, total, sums)
    if name:
      result.update({k.replace('eval/', f'eval/{name}/', 1): v
                     for k, v in setup.task.metrics(sums, dataset).items()})
  result = {**setup.task.metrics(total, dataset), **result}
  for task in setup.choice_tasks if choice_step else ():
    size = config.eval.batch_size
    rows = feed.process_rows(setup.batch_sharding, size)
    logliks = [np.asarray(choice_step(state.params, feed.to_global(
        local, setup.batch_sharding, size))['loglik']) for local in choice.batches(task, size, rows)]
    result.update(choice.metrics(task, np.concatenate(logliks)))
  return result


def compile_steps(setup: setup_lib.Setup, state: steps.TrainState) -> tuple:
  """(train step, state check, eval step, step cost): the first two compiled for `state`;
  the cost (zoo.run.perf) with the devices' peak, logged."""
  t0 = time.perf_counter()
  train_step = setup.jit_train_step().lower(state, setup.batch).compile()
  logging.info('compiled the train step in %.1f s', time.perf_counter() - t0)
  check_step = setup.jit_check_state().lower(state).compile()
  cost = perf.step_cost(setup, state, train_step)
  cost['peak_flops_per_device'], cost['peak_source'] = perf.peak_flops(
      setup.config.perf.peak_flops_per_device)
  logging.info('%s', perf.format_cost(cost))
  return train_step, check_step, setup.jit_eval_step(), cost


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> steps.TrainState:
  """See _train_and_evaluate; a storage error that names no file names the workdir, and the
  devices running out of memory is one line with what to change (zoo.run.memory)."""
  try:
    return _train_and_evaluate(config, Workdir(workdir))
  except OSError as e:
    raise Workdir(workdir).named(e) from None
  except jax.errors.JaxRuntimeError as e:  # Raised after the cleanups: lease released,
    if memory.is_device_oom(e):            # the last save finished or removed.
      raise memory.DeviceMemoryError(memory.oom_line(e)) from None
    raise


def _train_and_evaluate(config: ml_collections.ConfigDict, workdir: Workdir) -> steps.TrainState:
  """Trains `config`'s model in `workdir`, resuming from its checkpoints if there are any.

  Bad input raises ConfigError before anything is written. Between logs, evals and saves
  nothing comes back from the devices: the loop dispatches steps while the prefetch thread
  puts the next batches on the devices, and waits only for the step MAX_STEPS_AHEAD behind
  the newest.
  """
  cfg.validate(config, jax.device_count())
  workdir.check_writable()
  setup = setup_lib.checked(config)
  setup, loss_chunks = chunks.fitted(setup)  # May compile the train step: the loop reuses it.
  mesh, total, is_main = setup.mesh, config.train.steps, jax.process_index() == 0
  with setup.scope(), contextlib.ExitStack() as cleanup:  # Cleanups all run, last first.
    owner = workdir.hold(config.checkpoint.lease_seconds)  # Or exits: another job has it.
    cleanup.callback(owner.release)
    # From here the workdir is written.
    state, manager = checkpoint.restore_or_init(
        workdir.path, setup.abstract_state(), setup.create_state, setup.config.checkpoint,
        fresh=setup.trainable)
    saver = checkpoint.Saver(manager)
    cleanup.callback(saver.close)  # Waits for the last save: a failure raises from here.
    start = int(state.step)
    if is_main:
      workdir.write_text(Workdir.CONFIG, config.to_json_best_effort(indent=2))
    if setup.dataset.reference is not None:  # DPO: each pair's reference log-probabilities.
      reference.attach(setup, state, workdir)
    logging.info('mesh %s; config:\n%s', dict(mesh.shape), config)
    logging.info('parameters:\n%s', sharding.format_param_table(setup.param_table()))
    if loss_chunks:
      logging.info('%s', loss_chunks.line())
    if line := quantize.summary(config.model.get('quantization', 'none'),
                                *setup_lib.quantized(setup)):
      logging.info('%s', line)
    writer = metrics.MetricWriter(workdir.path, is_main, start,
                                  metrics.tracker(config, workdir.path))
    cleanup.callback(writer.close)
    stop = checkpoint.StopRequest(manager)  # A SIGTERM from here on saves a step and exits.
    cleanup.callback(stop.close)
    train_step, check_step, eval_step, cost = compile_steps(setup, state)
    choice_step = setup.jit_score_step() if setup.choice_tasks else None
    if is_main:
      workdir.write_json('model_info.json', {
          'mesh': dict(mesh.shape),
          'mesh_processes': np.vectorize(lambda d: d.process_index)(mesh.devices).tolist(),
          'feed': setup.placement.blocks(config.train.batch_size),  # Each process's block.
          'step_cost': cost, 'params': setup.param_table()})
    reporter = Reporter(setup, writer, cost, start)
    profile = profiling.Profile(config.profile.steps, workdir.path)
    cleanup.callback(profile.close)
    read_before = setup.dataset.examples_read() if setup.dataset.examples_read else 0
    source = rollouts.make(setup)  # GRPO: batches sampled from the policy itself.
    if source is None:
      train_batches = feed.TrainBatches(setup.dataset, setup.placement,
                                        config.train.batch_size, start, setup.arrange)
      cleanup.callback(train_batches.close)
      batches = feed.Prefetch(train_batches, start, total, config.data.prefetch)
      cleanup.callback(batches.close)
      quiet = batches.quiet
    else:
      quiet = contextlib.nullcontext
    train_step, check_step, eval_step = (alone_at_first(f, quiet)
                                         for f in (train_step, check_step, eval_step))
    choice_step = choice_step and alone_at_first(choice_step, quiet)
    in_flight = collections.deque()  # Losses of dispatched steps, oldest first.
    period = setup.task.period  # Steps between the points where the run may save.
    for step in range(start, total):
      profile.before(step)
      batch = (reporter.timed_wait(batches.get, step) if source is None else
               source.batch(state, step))  # A rollout: logged as perf/rollout_s.
      state, step_metrics = train_step(state, batch)
      if source is not None:
        step_metrics = {**step_metrics, **source.metrics}
      profile.after(step + 1, state)
      in_flight.append(step_metrics['train/loss'])
      if len(in_flight) > MAX_STEPS_AHEAD:
        in_flight.popleft().block_until_ready()
      reporter.flush()  # The previous log step's metrics, now that this step is dispatched.
      done = step + 1
      # The last step saves and evals anyway; GRPO saves between rollouts only.
      preempted = stop(done) and done < total and done % period == 0
      eval_due = is_due(done, config.eval.every_steps, total)
      save_due = is_due(done, config.checkpoint.every_steps, total) or preempted
      if eval_due or save_due:  # Raises on a non-finite state, so it is never saved.
        reporter.report(done, step_metrics, check_step(state))
      elif is_due(done, config.train.log_every_steps, total):
        reporter.defer(done, step_metrics, check_step(state))
      if save_due:
        owner.check()
        writer.sync()  # Rows up to this step outlast a failing disk, as the step will.
        saver.save(done, state)
      if preempted:
        logging.warning('stop requested (SIGTERM or preemption) at step %d: saved, exiting', done)
        break
      if eval_due:
        result = (source.evaluate(state.params, done) if source is not None else
                  evaluate(eval_step, state, setup, choice_step))
        reporter.evaluated(done, result, state.params)
    if setup.dataset.examples_read:  # Datasets read from files: what this process read.
      logging.info('process %d read %d training examples for %d steps (and any prefetched)',
                   jax.process_index(), setup.dataset.examples_read() - read_before,
                   int(state.step) - start)
  return state
