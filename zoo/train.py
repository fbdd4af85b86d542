"""Sharded training and evaluation: validate -> mesh -> data -> state -> loop."""
import collections
import dataclasses
import functools
import itertools
import json
import math
import os
import time
from typing import Any

from absl import logging
import flax
import flax.linen as nn
from flax.training import train_state
import jax
import jax.numpy as jnp
import numpy as np
import optax

from zoo import config as cfg
from zoo import checkpoint, data, metrics, models, optim, perf, sharding
from zoo.errors import NonFiniteError
from zoo.models import transformer_lm

# Variable collections a model updates as it trains (BatchNorm's running statistics):
# they live in the train state, are sharded like any state and are checkpointed.
STATE_COLLECTIONS = ('batch_stats',)
# Steps the loop may dispatch beyond the newest one the devices finished: enough to keep
# them busy, few enough that a stop request (SIGTERM) is served within a few steps and
# that few batches wait on the devices.
MAX_STEPS_AHEAD = 2


class TrainState(train_state.TrainState):
  """Flax's TrainState plus the model's mutable collections (empty for most models)."""
  model_state: Any = flax.struct.field(default_factory=dict)


def model_inputs(batch):
  """The model's positional inputs: the source, and for seq2seq the shifted target."""
  return [batch[k] for k in ('inputs', 'decoder_inputs') if k in batch]


def _loss(params, state, batch, rng):
  """Mean cross-entropy of a batch, and the model state the forward pass updated."""
  logits, model_state = state.apply_fn(
      {'params': params, **state.model_state}, *model_inputs(batch), train=True,
      rngs={'dropout': rng}, mutable=list(state.model_state))
  loss = optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), batch['targets']).mean()
  return loss, model_state


def _microbatches(x, k):
  """[B, ...] -> [k, B/k, ...], microbatch i = rows i, i+k, ...: each keeps every shard's share."""
  x = jnp.swapaxes(x.reshape((x.shape[0] // k, k) + x.shape[1:]), 0, 1)
  return nn.with_logical_constraint(x, (None, 'act_batch') + (None,) * (x.ndim - 2))


def train_step(state, batch, rng, microbatches=1):
  """One optimizer step on a global batch; returns the new state, the loss and the
  gradient norm (computed once, for the metric and for optim.clip_by_global_norm). The
  loop adds the parameter norm (check_state, a separate program) only at the steps it
  logs, evaluates or saves.

  Dropout keys derive from (rng, step), so a resumed run draws the same masks. With
  `microbatches` k > 1 the batch's gradient is the mean of k microbatch gradients,
  accumulated in float32 under `lax.scan`: activations of one microbatch live at a time.
  """
  rng = jax.random.fold_in(rng, state.step)
  grad_fn = jax.value_and_grad(_loss, has_aux=True)
  if microbatches == 1:
    (loss, model_state), grads = grad_fn(state.params, state, batch, rng)
  else:
    def accumulate(carry, xs):
      loss_sum, grad_sum, model_state = carry
      index, micro = xs
      (loss, model_state), grads = grad_fn(
          state.params, state.replace(model_state=model_state), micro, jax.random.fold_in(rng, index))
      grad_sum = jax.tree.map(lambda s, g: s + g.astype(jnp.float32), grad_sum, grads)
      return (loss_sum + loss, grad_sum, model_state), None
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
    micro = jax.tree.map(lambda x: _microbatches(x, microbatches), batch)
    (loss, grads, model_state), _ = jax.lax.scan(
        accumulate, (jnp.zeros((), jnp.float32), zeros, state.model_state),
        (jnp.arange(microbatches), micro))
    loss = loss / microbatches
    grads = jax.tree.map(lambda g, p: (g / microbatches).astype(p.dtype), grads, state.params)
  grad_norm = optax.tree.norm(grads)
  updates, opt_state = state.tx.update(grads, state.opt_state, state.params, grad_norm=grad_norm)
  params = optax.apply_updates(state.params, updates)
  new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                            model_state=model_state)
  return new_state, {'train/loss': loss, 'train/grad_norm': grad_norm}


def eval_step(state, batch):
  """Sums over a batch of loss, correct predictions, weight (per token for sequences) and
  exactly matched examples (every position right; for seq2seq, see `evaluate`)."""
  logits = state.apply_fn({'params': state.params, **state.model_state},
                          *model_inputs(batch)).astype(jnp.float32)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch['targets'])
  weights = jnp.broadcast_to(
      batch['weights'].reshape(batch['weights'].shape + (1,) * (loss.ndim - 1)), loss.shape)
  correct = jnp.argmax(logits, axis=-1) == batch['targets']
  exact = correct.reshape(correct.shape[0], -1).all(axis=1)
  return {'loss': (loss * weights).sum(), 'correct': (correct * weights).sum(),
          'weight': weights.sum(), 'exact': (exact * batch['weights']).sum(),
          'examples': batch['weights'].sum()}


def abstract_state(model, tx, example_batch, rng):
  """The train state's shapes with nn.Partitioned boxes holding the logical axis names."""
  def init(rng):
    variables = model.init({'params': rng, 'dropout': rng}, *model_inputs(example_batch))
    return TrainState.create(
        apply_fn=model.apply, params=variables['params'], tx=tx,
        model_state={k: variables[k] for k in STATE_COLLECTIONS if k in variables})
  return init, jax.eval_shape(init, rng)


@dataclasses.dataclass(frozen=True)
class Setup:
  """What a run builds before any array exists: placement, model, optimizer, state shapes."""
  mesh: jax.sharding.Mesh
  rules: list
  model: nn.Module
  tx: optax.GradientTransformation
  lr_schedule: Any
  batch_sharding: jax.sharding.NamedSharding
  init: Any              # rng -> boxed TrainState (see abstract_state).
  boxed: Any             # Its shapes, with logical axis names.
  state_shardings: Any
  rng: jax.Array         # The run's key: initialisation; dropout_rng derives from it.
  batch: Any             # A global train batch's shapes and sharding (ShapeDtypeStructs).

  @property
  def dropout_rng(self):
    return jax.random.fold_in(self.rng, 1)


def setup(config, dataset, mesh=None):
  """The Setup of `config` on its mesh (or on `mesh`): for the trainer, tools and tests."""
  if mesh is None:
    mesh = sharding.make_mesh(config.mesh.shape, config.mesh.axes, dcn_shape=config.mesh.dcn_shape)
  rules = [tuple(r) for r in config.logical_axis_rules]
  model = models.build(config.model, **dataset.model_fields)
  tx, lr_schedule = optim.make_optimizer(config.train.steps, **config.optimizer)
  batch_sharding = jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec(cfg.batch_mesh_axes(config) or None))
  rng = jax.random.key(config.seed)
  example = dataset.train_batch(0, config.train.batch_size, slice(0, 1))
  batch = {k: jax.ShapeDtypeStruct((config.train.batch_size,) + v.shape[1:], v.dtype,
                                   sharding=batch_sharding) for k, v in example.items()}
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    init, boxed = abstract_state(model, tx, jax.tree.map(jnp.zeros_like, example), rng)
  return Setup(mesh, rules, model, tx, lr_schedule, batch_sharding, init, boxed,
               sharding.logical_shardings(boxed, mesh, rules), rng, batch)


def checked_setup(config):
  """(dataset, Setup, parameter table) of a config that cfg.validate passed; ConfigError if
  the data or the parameter shardings do not fit it. Writes nothing."""
  dataset = data.load(config.data, config.seed)
  cfg.validate_with_data(config, dataset)
  run = setup(config, dataset)
  with jax.set_mesh(run.mesh), nn.logical_axis_rules(run.rules):
    table = sharding.param_table(run.boxed.params, run.mesh, run.rules)
    table += sharding.param_table(run.boxed.model_state, run.mesh, run.rules)  # BatchNorm's.
    cfg.validate_shardings(table, run.mesh, run.rules)
  return dataset, run, table


def check_state(state):
  """The parameter norm, and whether everything a checkpoint saves is finite."""
  finite = [jnp.isfinite(x).all() for x in jax.tree.leaves(checkpoint.saved_tree(state))]
  return {'train/param_norm': optax.tree.norm(state.params), 'state_finite': jnp.stack(finite).all()}


def step_cost(config, run, state, compiled, task):
  """FLOPs of one train step by zoo.perf's conventions and the tokens it trains on
  (sequence tasks), from the step traced for `state` (arrays or their shapes) and the
  `compiled` one."""
  with jax.set_mesh(run.mesh), nn.logical_axis_rules(run.rules):
    forward = perf.forward_flops(_loss, state.params, state, run.batch, run.dropout_rng)
  cost = {'model_flops': 3 * forward, 'xla_flops_per_device': perf.xla_flops(compiled),
          'devices': run.mesh.size}
  if task in ('lm', 'seq2seq'):
    cost['tokens'] = math.prod(run.batch['targets'].shape)
  if config.model.name == 'transformer_lm':
    cost['lm_analytic_flops'] = perf.lm_train_flops(run.model, *run.batch['inputs'].shape)
  return cost


def format_cost(cost):
  """The log line of a step_cost (with the peak, if it has one)."""
  f = perf.format_flops
  analytic = f', LM analytic {f(cost["lm_analytic_flops"])}' if 'lm_analytic_flops' in cost else ''
  line = (f'FLOPs per train step: {f(cost["model_flops"])} model (3 x forward matmuls{analytic}); '
          f'XLA cost analysis {f(cost["xla_flops_per_device"])} per device x {cost["devices"]} '
          '(loop bodies counted once)')
  if 'peak_source' in cost:
    line += '; peak ' + (f'{f(cost["peak_flops_per_device"])}/s per device ({cost["peak_source"]})'
                         if cost['peak_flops_per_device'] else cost['peak_source'])
  return line


def create_train_state(init, rng, state_shardings):
  """Initialises the state directly into its shards: never materialised replicated."""
  return jax.jit(lambda r: nn.meta.unbox(init(r)), out_shardings=state_shardings)(rng)


def jit_steps(state_shardings, batch_sharding, rng, microbatches=1):
  """The jitted train step (state donated) and eval step, with explicit shardings.

  The train step takes (state, batch); `rng` (dropout's base key) is bound into it.
  """
  step = functools.partial(train_step, rng=rng, microbatches=microbatches)
  p_train = jax.jit(step, in_shardings=(state_shardings, batch_sharding),
                    out_shardings=(state_shardings, None), donate_argnums=0)
  p_eval = jax.jit(eval_step, in_shardings=(state_shardings, batch_sharding))
  return p_train, p_eval


def evaluate(p_eval, state, dataset, config, batch_sharding, task):
  """Loss and accuracy over the eval split (per token for sequences).

  An LM adds bits per character. seq2seq adds exact match: the fraction of examples whose
  every target token is the argmax under teacher forcing, which is exactly the fraction
  that greedy decoding gets entirely right (each greedy step then sees the true prefix).
  """
  size = config.eval.batch_size
  rows = data.process_rows(batch_sharding, size)
  sums = None
  for local in itertools.islice(dataset.eval_batches(size, rows), config.eval.max_batches or None):
    out = p_eval(state, data.to_global(local, batch_sharding, size))
    sums = out if sums is None else jax.tree.map(jnp.add, sums, out)
  sums = jax.device_get(sums)
  loss = float(sums['loss'] / sums['weight'])
  result = {'eval/loss': loss, 'eval/accuracy': float(sums['correct'] / sums['weight'])}
  if task == 'lm':
    result['eval/bits_per_char'] = loss / math.log(2)
  if task == 'seq2seq':
    result['eval/exact_match'] = float(sums['exact'] / sums['examples'])
  return result


def make_sampler(model, dataset, config, mesh):
  """A function params -> text continuing a held-out prompt, same on every process."""
  tokens = next(iter(dataset.eval_batches(1, slice(0, 1))))['inputs']  # [1, seq_len]
  prompt_len = tokens.shape[1] // 4
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  gen = jax.jit(functools.partial(transformer_lm.generate, model.apply, prompt_len=prompt_len,
                                  window=model.max_len, temperature=config.eval.sample_temperature),
                out_shardings=replicated)

  def sample(params, step):
    rng = jax.random.fold_in(jax.random.key(config.seed), step)
    out = np.asarray(gen({'params': params}, tokens, rng=rng))
    return dataset.decode(out[0, :prompt_len]), dataset.decode(out[0, prompt_len:])
  return sample


def _write_json(workdir, name, obj):
  with open(os.path.join(workdir, name), 'w', encoding='utf-8') as f:
    f.write(obj if isinstance(obj, str) else json.dumps(obj, indent=2))


def restore_target(init, state_shardings, rng):
  """(abstract unboxed state, the checkpointed part of it carrying the current shardings)."""
  abstract = jax.eval_shape(lambda r: nn.meta.unbox(init(r)), rng)
  return abstract, checkpoint.abstract_target(checkpoint.saved_tree(abstract),
                                                 checkpoint.saved_tree(state_shardings))


def initial_state(config, workdir, init, state_shardings, rng):
  """Resumes from the newest checkpoint in the workdir, else warm-starts or initialises.

  Returns (state, checkpoint manager). Restores read straight into the current shardings,
  whatever mesh wrote the checkpoint. A checkpoint (or init_from) that does not fit fails
  before anything is written.
  """
  abstract, target = restore_target(init, state_shardings, rng)
  c = config.checkpoint
  make_manager = lambda: checkpoint.make_manager(workdir, c.keep, c.async_save, c.replica_parallel)
  manager = None
  if checkpoint.exists_on_process_0(workdir):
    manager = make_manager()
    restored, step = checkpoint.restore_latest(manager, target, c.fallback)
    if restored is not None:
      logging.info('resuming from step %d of %s', step, manager.directory)
      return abstract.replace(**restored), manager
  state = create_train_state(init, rng, state_shardings)
  if c.init_from:
    params, step, source = checkpoint.restore_params(c.init_from, target['params'])
    logging.info('initialised params from step %d of %s (optimizer state fresh)', step, source)
    state = state.replace(params=params)
  return state, manager or make_manager()


class Profile:
  """Traces steps [a, b) with jax.profiler into workdir/profile (TensorBoard's profile tab
  or Perfetto read it); with several processes each writes workdir/profile/process_<i>
  (trace files are named by host, which processes on one host share). () traces nothing."""

  def __init__(self, steps, workdir):
    self.steps, self.active = tuple(steps), False
    self.directory = os.path.join(workdir, 'profile')
    if jax.process_count() > 1:
      self.directory = os.path.join(self.directory, f'process_{jax.process_index()}')

  def before(self, step):
    if self.steps and step == self.steps[0]:
      jax.profiler.start_trace(self.directory)
      self.active = True

  def after(self, done, state):
    if self.active and done == self.steps[1]:
      jax.block_until_ready(state)  # The trace ends after the last traced step ran.
      self.close()
      logging.info('profile of steps [%d, %d) written to %s', *self.steps, self.directory)

  def close(self):
    if self.active:
      jax.profiler.stop_trace()
      self.active = False


def train_and_evaluate(config, workdir):
  """Trains `config`'s model in `workdir`, resuming from its checkpoints if there are any.

  Bad input raises ConfigError before anything is written.
  """
  cfg.validate(config, jax.device_count())
  cfg.check_workdir(workdir)
  dataset, run, table = checked_setup(config)
  task = dataset.task
  mesh, rules, model, batch_sharding = run.mesh, run.rules, run.model, run.batch_sharding
  batch_size, total_steps = config.train.batch_size, config.train.steps
  rows = data.process_rows(batch_sharding, batch_size)
  is_main = jax.process_index() == 0

  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    state, manager = initial_state(config, workdir, run.init, run.state_shardings, run.rng)
    # From here on the workdir is written.
    start_step = int(state.step)
    if is_main:
      _write_json(workdir, 'config.json', config.to_json_best_effort(indent=2))
    logging.info('mesh %s; config:\n%s', dict(mesh.shape), config)
    logging.info('parameters:\n%s', sharding.format_param_table(table))

    p_train, p_eval = jit_steps(run.state_shardings, batch_sharding, run.dropout_rng,
                                config.train.microbatches)
    sample = make_sampler(model, dataset, config, mesh) if task == 'lm' else None
    writer = metrics.MetricWriter(workdir, is_main, start_step)
    stop = checkpoint.StopRequest(manager)

    t0 = time.perf_counter()
    p_train = p_train.lower(state, run.batch).compile()
    logging.info('compiled the train step in %.1f s', time.perf_counter() - t0)
    p_check = jax.jit(check_state, in_shardings=(run.state_shardings,)).lower(state).compile()
    cost = step_cost(config, run, state, p_train, task)
    cost['peak_flops_per_device'], cost['peak_source'] = perf.peak_flops(
        config.perf.peak_flops_per_device)
    logging.info('%s', format_cost(cost))
    if is_main:
      _write_json(workdir, 'model_info.json', {
          'mesh': dict(mesh.shape),
          'mesh_processes': np.vectorize(lambda d: d.process_index)(mesh.devices).tolist(),
          'step_cost': cost, 'params': table})

    def make_batch(step):
      return data.to_global(dataset.train_batch(step, batch_size, rows), batch_sharding, batch_size)

    def log_due(step):
      return step % config.train.log_every_steps == 0 or step == total_steps

    timer = {'time': time.perf_counter(), 'step': start_step}

    def report(step, device_metrics):
      """Fetches a step's metrics (the loop's only transfer from the devices between logs,
      evals and saves), checks they and the state are finite and, at a log step, writes
      them. A non-finite value is found at the first such step after it happened."""
      scalars = jax.device_get(device_metrics)
      for name in ('train/loss', 'train/param_norm'):
        if not np.isfinite(scalars[name]):
          raise NonFiniteError(
              f'non-finite {name} {scalars[name]} at step {step}; nothing was checkpointed after '
              'it. Lower optimizer.learning_rate or enable optimizer.grad_clip_norm')
      if not scalars.pop('state_finite'):
        raise NonFiniteError(
            f'non-finite optimizer or model state at step {step}; nothing was checkpointed after '
            'it. Lower optimizer.learning_rate or enable optimizer.grad_clip_norm')
      if not log_due(step):
        return
      now = time.perf_counter()
      step_time = (now - timer['time']) / max(step - timer['step'], 1)
      scalars.update({'train/learning_rate': run.lr_schedule(step - 1),
                      'perf/step_time_s': step_time, 'perf/examples_per_s': batch_size / step_time,
                      'perf/flops_per_step': cost['model_flops']})
      if 'tokens' in cost:
        scalars['perf/tokens_per_s'] = cost['tokens'] / step_time
      if cost['peak_flops_per_device']:
        scalars['perf/mfu'] = perf.mfu(cost['model_flops'], step_time, cost['devices'],
                                       cost['peak_flops_per_device'])
      writer.write(step, scalars)
      metrics.log_progress(step, total_steps, scalars, step_time * (total_steps - step))
      timer.update(time=time.perf_counter(), step=step)

    # Between logs, evals and saves nothing comes back from the devices: the loop
    # dispatches steps while the prefetch thread puts the next batches on the devices,
    # waits only for the step MAX_STEPS_AHEAD behind the newest, and fetches a log step's
    # metrics after dispatching the following step.
    batches = data.Prefetch(make_batch, start_step, total_steps, config.data.prefetch)
    pending, profile = None, Profile(config.profile.steps, workdir)
    in_flight = collections.deque()
    try:
      for step in range(start_step, total_steps):
        profile.before(step)
        state, step_metrics = p_train(state, batches.get(step))
        profile.after(step + 1, state)
        in_flight.append(step_metrics['train/loss'])
        if len(in_flight) > MAX_STEPS_AHEAD:
          in_flight.popleft().block_until_ready()
        if pending:
          report(*pending)
          pending = None
        done = step + 1
        preempted = stop(done) and done < total_steps  # The last step saves and evals anyway.
        eval_due = done % config.eval.every_steps == 0 or done == total_steps
        save_due = done % config.checkpoint.every_steps == 0 or done == total_steps or preempted
        if eval_due or save_due or log_due(done):
          step_metrics.update(p_check(state))
        if eval_due or save_due:
          report(done, step_metrics)  # Raises on a non-finite state, so it is never saved.
        elif log_due(done):
          pending = (done, step_metrics)
        if save_due:
          manager.save(done, args=checkpoint.save_args(checkpoint.saved_tree(state)), force=True)
        if preempted:
          logging.warning('stop requested (SIGTERM or preemption) at step %d: saved, exiting', done)
          break
        if eval_due:
          result = evaluate(p_eval, state, dataset, config, batch_sharding, task)
          writer.write(done, result)
          logging.info('eval at step %d: %s', done,
                       '  '.join(f'{k} {v:.4f}' for k, v in result.items()))
          if sample:
            prompt, text = sample(state.params, done)
            logging.info('sample at step %d: %r -> %r', done, prompt, text)
            writer.text(done, 'eval/sample', prompt + ' -> ' + text)
          timer.update(time=time.perf_counter(), step=done)
    finally:
      batches.close()
      profile.close()
      stop.close()
      manager.wait_until_finished()
      manager.close()
      writer.close()
  return state
