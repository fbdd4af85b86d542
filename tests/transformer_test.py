"""The Transformer switches: causality, scan == unrolled, remat == none, bf16 ~ f32,
gradient accumulation == one big batch, dropout keyed by step and the same on every mesh."""
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import load_config, trainer
from zoo import models


# The smoke LM, narrower and shorter: these tests compare numbers, not learning. 16 rows:
# 4 microbatches of one row per batch shard each. No warmup: every step after the first
# follows a real update (smoke's warmup starts at a rate of 0).
# Every test starts from these (positions named too), so that one Trainer (its programs
# compiled once) serves each test that needs this LM as it is.
TINY = {'mesh.shape': (4, 2), 'model.d_model': 32, 'model.num_heads': 4, 'model.mlp_dim': 64,
        'model.max_len': 16, 'data.seq_len': 16, 'train.batch_size': 16,
        'optimizer.warmup_steps': 0, 'model.positions': 'learned'}


def _lm(**overrides):
  """The tiny LM's Trainer (built once per session for given overrides)."""
  return trainer('char_lm', **{**TINY, **overrides})


def _loss_and_grads(t, apply_fn=None):
  """params -> the loss and parameter gradients of t's first batch, without dropout (t's
  model by default); to be jitted under t's scope."""
  batch, apply_fn = t.batch(0), apply_fn or t.initial.apply_fn
  def loss(p):
    logits = apply_fn({'params': p}, batch['inputs'])
    return jnp.mean(-jnp.take_along_axis(jax.nn.log_softmax(logits), batch['targets'][..., None], -1))
  return jax.value_and_grad(loss)


@pytest.mark.parametrize('positions', ['learned', 'rotary'])
def test_lm_is_causal(positions, devices):
  """The loss at position t has zero gradient with respect to the inputs after t."""
  del devices
  t = _lm(**{'model.positions': positions})
  tokens = t.batch(0)['inputs'][:2]
  length, pos = tokens.shape[1], 9
  shape = (2, length, t.config.model.d_model)

  def loss_at(perturbation):
    logits = t.model.apply({'params': t.initial.params, 'perturbations': {'embedded': perturbation}},
                           tokens)
    return jax.nn.log_softmax(logits[:, pos])[:, 0].sum()
  with t.scope():
    grads = np.asarray(jax.jit(jax.grad(loss_at))(jnp.zeros(shape)))
  per_position = np.abs(grads).sum(axis=(0, 2))
  assert np.all(per_position[pos + 1:] == 0), per_position
  assert np.all(per_position[:pos + 1] > 0), per_position


def _stack_blocks(params, num_layers):
  """Unrolled params (block_0 .. block_{n-1}) -> the scanned layout (blocks, stacked on axis 0)."""
  params = flax.core.unfreeze(params)
  layers = [params.pop(f'block_{i}') for i in range(num_layers)]
  params['blocks'] = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
  return params


def test_scan_and_remat_leave_the_numbers_unchanged(devices):
  """Unrolled == scanned (params restacked), and remat ('full', 'dots') == none."""
  del devices
  rotary = {'model.positions': 'rotary'}
  unrolled = _lm(**rotary)
  layers, params = unrolled.config.model.num_layers, unrolled.initial.params
  stacked = _stack_blocks(params, layers)
  variants = [({'model.remat': 'full'}, params),
              ({'model.scan_layers': True}, stacked),
              ({'model.scan_layers': True, 'model.remat': 'dots'}, stacked)]
  functions = [_loss_and_grads(unrolled)]
  for overrides, variant_params in variants:
    config = load_config('char_lm', **{**TINY, **rotary, **overrides})
    model = models.build(config.model, **unrolled.dataset.model_fields)
    with unrolled.scope():  # Same mesh and rules; only the model differs.
      shapes = jax.eval_shape(model.init, jax.random.key(0), unrolled.batch(0)['inputs'])['params']
    assert jax.tree.structure(variant_params) == jax.tree.structure(nn.meta.unbox(shapes)), overrides
    functions.append(_loss_and_grads(unrolled, model.apply))
  with unrolled.scope():  # The four in one program: a compile each was most of the test's time.
    (loss, grads), *results = jax.jit(lambda ps: [f(p) for f, p in zip(functions, ps)])(
        [params] + [p for _, p in variants])
  stacked_grads = _stack_blocks(grads, layers)
  for (overrides, _), (loss_v, grads_v) in zip(variants, results):
    want_grads = stacked_grads if overrides.get('model.scan_layers') else grads
    np.testing.assert_allclose(loss_v, loss, rtol=1e-6, err_msg=str(overrides))
    for a, b in zip(jax.tree.leaves(grads_v), jax.tree.leaves(want_grads)):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7, err_msg=str(overrides))


def test_bf16_training_stays_close_to_f32(devices):
  del devices
  f32 = _lm().run(10)
  bf16_trainer = _lm(**{'model.dtype': 'bfloat16'})
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(bf16_trainer.state.params))
  bf16 = bf16_trainer.run(10)
  assert f32[-1] < 0.9 * f32[0]  # Both learn ...
  np.testing.assert_allclose(bf16, f32, rtol=0.02)  # ... along the same curve, within 2%.
  assert bf16 != f32  # And bf16 really computed in bf16.


# SGD at a constant learning rate of 1, no momentum, decay or clipping: a step moves the
# parameters by exactly minus the gradient, so the update is the accumulated gradient itself.
PLAIN_SGD = {'optimizer.name': 'sgd', 'optimizer.learning_rate': 1.0, 'optimizer.momentum': 0.0,
             'optimizer.schedule': 'constant', 'optimizer.warmup_steps': 0,
             'optimizer.weight_decay': 0.0, 'optimizer.grad_clip_norm': 0.0}


@pytest.mark.parametrize('experiment,overrides', [('char_lm', TINY)])
def test_gradient_accumulation_equals_one_big_batch(experiment, overrides, devices):
  """k microbatches give the big batch's gradient (its mean, not its sum or one part) and,
  over several AdamW steps with no warmup, the same losses, gradient norms and parameters.
  Not for BatchNorm models: their statistics are per microbatch, as in other codebases."""
  del devices
  # 16 rows on 4 batch shards: 4 microbatches of 4 rows, one per shard each. (With TINY's
  # own optimizer, the big batch's Trainer is the one the other tests here use.)
  def run(k, steps, **optimizer):
    t = trainer(experiment, **{'mesh.shape': (4, 2), **overrides, 'train.batch_size': 16,
                               'optimizer.warmup_steps': 0, **optimizer},
                **({'train.microbatches': k} if k > 1 else {}))
    t.run(steps)
    return t

  def gradient(t):  # Minus the one SGD step's update.
    return [np.asarray(a) - np.asarray(b) for a, b in
            zip(jax.tree.leaves(t.initial.params), jax.tree.leaves(t.state.params))]
  big, accumulated = run(1, 1, **PLAIN_SGD), run(4, 1, **PLAIN_SGD)
  assert max(np.abs(g).max() for g in gradient(big)) > 1e-3  # A real gradient moved them.
  for a, b in zip(gradient(accumulated), gradient(big)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
  for big, accumulated in [(big, accumulated), (run(1, 3), run(4, 3))]:  # SGD's, then AdamW's.
    for key in ('train/loss', 'train/grad_norm'):
      np.testing.assert_allclose([m[key] for m in accumulated.metrics],
                                 [m[key] for m in big.metrics], rtol=1e-5, err_msg=key)
  moved = [np.abs(np.asarray(a) - np.asarray(b)).max() for a, b in
           zip(jax.tree.leaves(big.initial.params), jax.tree.leaves(big.state.params))]
  assert min(moved) > 1e-3, 'an AdamW step without warmup moves every parameter'
  # AdamW divides by the gradient's running RMS: a parameter whose gradient is near zero
  # may move ~1e-6 differently under float32 sums in another order, of a 3e-3 step.
  for a, b in zip(jax.tree.leaves(accumulated.state.params), jax.tree.leaves(big.state.params)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_dropout_is_keyed_by_step_and_the_same_on_every_mesh(devices):
  del devices
  # No warmup (TINY's): steps 2 and 3 follow real updates.
  dropout = {'model.dropout_rate': 0.2}
  runs = {shape: _lm(**{'mesh.shape': shape}, **dropout).run(3) for shape in [(4, 2), (2, 4)]}
  np.testing.assert_allclose(runs[(2, 4)], runs[(4, 2)], rtol=2e-5)
  no_dropout = _lm().run(3)
  assert not np.allclose(runs[(4, 2)], no_dropout, rtol=1e-4)  # Masks were drawn.

  t = _lm(**dropout)
  def first_loss(step):
    state = jax.tree.map(lambda x: x.copy(), t.initial)
    state = state.replace(step=state.step + step)  # Same dtype and sharding: no recompile.
    with t.scope():
      return float(t.train_step(state, t.batch(0))[1]['train/loss'])
  assert first_loss(0) == runs[(4, 2)][0]  # Same step, same masks: a resumed run repeats them.
  assert first_loss(5) != first_loss(0)    # Another step draws other masks.


def test_microbatches_must_divide_the_batch(devices):
  from zoo.run import config as cfg  # pylint: disable=import-outside-toplevel
  from zoo.errors import ConfigError  # pylint: disable=import-outside-toplevel
  config = load_config('char_lm', **{**TINY, 'train.microbatches': 3})
  with pytest.raises(ConfigError, match='config.train.microbatches: 3'):
    cfg.validate(config, len(devices))
