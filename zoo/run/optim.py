"""The optax optimizer built from `config.optimizer`."""
import jax
import jax.numpy as jnp
import optax

from zoo.errors import fail

OPTIMIZERS = ('adamw', 'sgd')
SCHEDULES = ('constant', 'cosine', 'linear')


def check_config(c) -> None:
  """Raises ConfigError naming the first bad `optimizer.*` field."""
  if not c.learning_rate > 0:
    fail('optimizer.learning_rate', f'must be positive, got {c.learning_rate}')
  if c.name not in OPTIMIZERS:
    fail('optimizer.name', f'unknown optimizer {c.name!r}; known: {", ".join(OPTIMIZERS)}')
  if c.schedule not in SCHEDULES:
    fail('optimizer.schedule', f'unknown schedule {c.schedule!r}; known: {", ".join(SCHEDULES)}')


def make_schedule(learning_rate: float, schedule: str, warmup_steps: int,
                  total_steps: int) -> optax.Schedule:
  """Linear warmup from 0 to `learning_rate`, then constant, cosine or linear decay to 0."""
  decay_steps = max(total_steps - warmup_steps, 1)
  after = {
      'constant': optax.constant_schedule(learning_rate),
      'cosine': optax.cosine_decay_schedule(learning_rate, decay_steps),
      'linear': optax.linear_schedule(learning_rate, 0.0, decay_steps),
  }[schedule]
  if warmup_steps <= 0:
    return after
  warmup = optax.linear_schedule(0.0, learning_rate, warmup_steps)
  return optax.join_schedules([warmup, after], [warmup_steps])


def make_optimizer(total_steps: int, *, name: str, learning_rate: float, schedule: str,
                   warmup_steps: int, weight_decay: float, grad_clip_norm: float, b1: float,
                   b2: float, momentum: float
                   ) -> tuple[optax.GradientTransformationExtraArgs, optax.Schedule]:
  """Returns (optax transformation, learning-rate schedule).

  Weight decay applies to matrices only (ndim >= 2), not to biases or norm scales.
  `grad_clip_norm` <= 0 disables clipping by global norm.
  """
  lr = make_schedule(learning_rate, schedule, warmup_steps, total_steps)
  matrices = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  if name == 'adamw':
    tx = optax.adamw(lr, b1=b1, b2=b2, weight_decay=weight_decay, mask=matrices)
  else:  # 'sgd'
    tx = optax.chain(optax.add_decayed_weights(weight_decay, mask=matrices),
                     optax.sgd(lr, momentum=momentum or None))
  if grad_clip_norm > 0:
    tx = optax.chain(clip_by_global_norm(grad_clip_norm), tx)
  return optax.with_extra_args_support(tx), lr  # update(..., grad_norm=) either way.


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
  """optax.clip_by_global_norm that can take the norm from its caller (`grad_norm=`): the
  train step computes it once for the clip and its metric. Without sharded gradients'
  norm computed twice, XLA would run two sets of cross-device reductions."""
  def init(params):
    del params
    return optax.EmptyState()

  def update(updates, state, params=None, *, grad_norm=None, **extra_args):
    del params, extra_args
    norm = optax.tree.norm(updates) if grad_norm is None else grad_norm
    scale = jnp.where(norm < max_norm, 1.0, max_norm / norm)
    return jax.tree.map(lambda g: g * scale.astype(g.dtype), updates), state
  return optax.GradientTransformationExtraArgs(init, update)
