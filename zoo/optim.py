"""The optax optimizer built from `config.optimizer`."""
import jax
import optax

OPTIMIZERS = ('adamw', 'sgd')
SCHEDULES = ('constant', 'cosine', 'linear')


def make_schedule(learning_rate, schedule, warmup_steps, total_steps):
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


def make_optimizer(total_steps, *, name, learning_rate, schedule, warmup_steps,
                   weight_decay, grad_clip_norm, b1, b2, momentum):
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
    tx = optax.chain(optax.clip_by_global_norm(grad_clip_norm), tx)
  return tx, lr
