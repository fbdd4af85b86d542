"""The train state and the pure, jitted functions over it: train step, eval step, state check.

Every function here is traced under the Setup's scope (mesh + logical axis rules), so the
model's activation constraints are kept; a Setup's jit_train_step() and friends bind its
shardings.
"""
import functools
from typing import Any, Callable, Optional

import flax
import flax.linen as nn
import flax.traverse_util
from flax.training import train_state
import jax
import jax.numpy as jnp
import optax

from zoo.models import attention
from zoo.run.tasks import Task

# Variable collections a model updates as it trains (BatchNorm's running statistics):
# they live in the train state, are sharded like any state and are checkpointed.
STATE_COLLECTIONS = ('batch_stats',)


class TrainState(train_state.TrainState):
  """Flax's TrainState plus the model's mutable collections (empty for most models)."""
  model_state: Any = flax.struct.field(default_factory=dict)


# Which parameters train, by their path of names; None: all of them. With LoRA, the
# adapters only (zoo.models.lora.is_adapter): the rest get no gradient, no optimizer state.
Trainable = Optional[Callable[[tuple], bool]]


def split(params: Any, trainable: Callable[[tuple], bool]) -> tuple[dict, dict]:
  """(the trainable parameters, the frozen ones), each a nested dict of the same paths."""
  flat = flax.traverse_util.flatten_dict(params)
  unflat = flax.traverse_util.unflatten_dict
  return (unflat({k: v for k, v in flat.items() if trainable(k)}),
          unflat({k: v for k, v in flat.items() if not trainable(k)}))


def merge(trained: dict, frozen: dict) -> dict:
  """The whole parameter tree again from split's two parts."""
  flat = {**flax.traverse_util.flatten_dict(trained), **flax.traverse_util.flatten_dict(frozen)}
  return flax.traverse_util.unflatten_dict(flat)


def state_initializer(model: nn.Module, optimizer: optax.GradientTransformation, task: Task,
                      example_batch: dict, trainable: Trainable = None
                      ) -> Callable[[jax.Array], TrainState]:
  """rng -> a fresh TrainState whose leaves are nn.Partitioned boxes with logical axis names;
  the optimizer's state covers only the `trainable` parameters."""
  def init_state(rng):
    variables = model.init({'params': rng, 'dropout': rng}, *task.model_inputs(example_batch),
                           **task.model_keywords(example_batch))
    params = variables['params']
    # A strongly typed step: a restored one is, and a weakly typed 0 would make a fresh run's
    # train step (which feeds the step to the learning-rate schedule) another program than a
    # resumed run's, compiled again on every restart.
    return TrainState(
        step=jnp.zeros((), jnp.int32), apply_fn=model.apply, params=params, tx=optimizer,
        opt_state=optimizer.init(split(params, trainable)[0] if trainable else params),
        model_state={k: variables[k] for k in STATE_COLLECTIONS if k in variables})
  return init_state


def loss(params: Any, state: TrainState, batch: dict, rng: jax.Array, task: Task,
         total: jax.Array, figure_total: Optional[jax.Array] = None) -> tuple[jax.Array, tuple]:
  """The batch's loss (the task's, summed over the targets that count) over `total`, the
  targets that count in the whole global batch (every microbatch), plus the model's own
  weighted losses (a dict output's 'aux_loss': routed experts' router losses) at the
  batch's share of `total`. Also returns the model state the forward pass updated, and
  {'loss': the task's loss alone, the task's figures over `figure_total` (default
  `total`), the model's 'aux_metrics'...} at that share (summed over microbatches, each is
  the batch's)."""
  with attention.balanced_rows(task.balanced):  # Setup.arrange fed them so.
    out, model_state = state.apply_fn(
        {'params': params, **state.model_state}, *task.model_inputs(batch),
        **task.model_keywords(batch), train=True, rngs={'dropout': rng},
        mutable=list(state.model_state))
  value = task.loss_sum(out, batch) / total
  per = total if figure_total is None else figure_total
  figures = {'loss': value, **{k: v / per for k, v in task.figures(out, batch).items()}}
  if isinstance(out, dict) and 'aux_loss' in out:
    share = task.counted(batch) / total
    figures.update({k: v * share for k, v in out['aux_metrics'].items()})
    figures['aux_loss'] = out['aux_loss'] * share
    value = value + figures['aux_loss']
  return value, (model_state, figures)


def _microbatches(x, k):
  """[B, ...] -> [k, B/k, ...], microbatch i = rows i, i+k, ...: each keeps every shard's share."""
  x = jnp.swapaxes(x.reshape((x.shape[0] // k, k) + x.shape[1:]), 0, 1)
  return nn.with_logical_constraint(x, (None, 'act_batch') + (None,) * (x.ndim - 2))


def dropout_key(seed: int, step: jax.Array) -> jax.Array:
  """The dropout key of a step, fold_in(fold_in(key(seed), 1), step): a resumed run draws
  the same masks. Computed inside the step, so that setting up a run runs nothing on the
  devices (compile-only TPU devices can run nothing at all)."""
  return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), 1), step)


def train_step(state: TrainState, batch: dict, seed: int, task: Task,
               microbatches: int = 1, trainable: Trainable = None,
               lr_schedule: Optional[optax.Schedule] = None) -> tuple[TrainState, dict]:
  """One optimizer step on a global batch; returns the new state, the loss, the gradient
  norm (computed once, for the metric and for optim.clip_by_global_norm), the model's
  own figures (routed experts' router losses and loads: `loss`'s) and, given the
  optimizer's `lr_schedule`, the step's learning rate. The loop adds the parameter norm
  (check_state, a separate program) only at the steps it logs, evaluates or saves.

  The learning rate is computed here, not by the host when it logs: the schedule's eager
  operations would queue behind the next step, which is already dispatched (0.13 s a
  logged row on 8 CPU devices), and it arrives with the other metrics in one transfer.

  Dropout keys derive from (seed, step) (dropout_key), so a resumed run draws the same
  masks. The loss is the mean over every target that counts in the global batch (see
  `loss`). With `microbatches` k > 1 each microbatch's share of it is differentiated and
  the k gradients summed in float32 under `lax.scan`: activations of one microbatch live
  at a time, and a microbatch with more padding weighs less, as in the whole batch.

  With `trainable`, only those parameters are differentiated and updated: the frozen
  ones are constants of the step, so nothing computes, reduces or stores their gradients.
  """
  rng = dropout_key(seed, state.step)
  total = task.counted(batch)
  objective = functools.partial(loss, task=task, total=total,
                                figure_total=task.figure_total(batch))
  trained, frozen = split(state.params, trainable) if trainable else (state.params, None)
  if trainable:
    objective = lambda p, *args, f=objective: f(merge(p, frozen), *args)
  grad_fn = jax.value_and_grad(objective, has_aux=True)
  if microbatches == 1:
    (_, (model_state, figures)), grads = grad_fn(trained, state, batch, rng)
  else:
    def accumulate(carry, xs):
      sums, grad_sum, model_state = carry
      index, micro = xs
      micro_state = state.replace(model_state=model_state)
      (_, (model_state, figures)), grads = grad_fn(trained, micro_state, micro,
                                                   jax.random.fold_in(rng, index))
      grad_sum = jax.tree.map(lambda s, g: s + g.astype(jnp.float32), grad_sum, grads)
      return (jax.tree.map(jnp.add, sums, figures), grad_sum, model_state), None
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), trained)
    micro = jax.tree.map(lambda x: _microbatches(x, microbatches), batch)
    first = jax.tree.map(lambda x: x[0], micro)  # The figures' shapes: a forward pass's.
    shapes = jax.eval_shape(lambda: objective(trained, state, first, rng)[1][1])
    no_figures = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    (figures, grads, model_state), _ = jax.lax.scan(
        accumulate, (no_figures, zeros, state.model_state), (jnp.arange(microbatches), micro))
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, trained)
  grad_norm = optax.tree.norm(grads)
  updates, opt_state = state.tx.update(grads, state.opt_state, trained, grad_norm=grad_norm)
  params = optax.apply_updates(trained, updates)
  if trainable:
    params = merge(params, frozen)
  new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                            model_state=model_state)
  metrics = {f'train/{name}': value for name, value in figures.items()}
  metrics['train/grad_norm'] = grad_norm
  if lr_schedule is not None:  # The rate this update used: the count before it.
    metrics['train/learning_rate'] = lr_schedule(state.step)
  if 'mask' in batch:  # The fraction of the batch's targets that are padding.
    metrics['train/padding'] = 1.0 - batch['mask'].sum(dtype=jnp.float32) / batch['mask'].size
  return new_state, metrics


def eval_step(state: TrainState, batch: dict, task: Task) -> dict:
  """The task's sums over a batch (Task.eval_sums: loss, correct predictions, weight, ...),
  which it turns into metrics over the split."""
  with attention.balanced_rows(task.balanced):  # Setup.arrange fed them so.
    out = state.apply_fn({'params': state.params, **state.model_state},
                         *task.model_inputs(batch), **task.model_keywords(batch))
  return task.eval_sums(out, batch)


def score_step(params: Any, batch: dict, apply_fn: Callable, task: Task) -> dict:
  """Each row's score under the model (Task.scores: a language model's log-likelihood of
  the masked targets, and whether they are all the likeliest tokens)."""
  out = apply_fn({'params': params}, *task.model_inputs(batch), **task.model_keywords(batch))
  return task.scores(out, batch)


def check_state(state: TrainState) -> dict:
  """The parameter norm, and whether everything a checkpoint saves is finite."""
  finite = [jnp.isfinite(x).all() for x in jax.tree.leaves(state)]  # What a checkpoint saves.
  return {'train/param_norm': optax.tree.norm(state.params),
          'state_finite': jnp.stack(finite).all()}
