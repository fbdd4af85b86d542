"""model.attention='splash': the Pallas kernel (interpreted on CPU) computes XLA's attention
and its gradients on every mesh, trains the same LM, says once where it cannot run, and
compiles for a TPU pod."""
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import load_config, trainer
from zoo.models import attention, splash, transformer
from zoo.parallel import mesh as mesh_lib
from zoo.parallel import context, sharding, topology
from zoo.run import perf, setup as setup_lib


def _attention(impl, heads, kv_heads, causal, length=128, query_scale_dim=0):
  return transformer.Attention(num_heads=heads, num_kv_heads=kv_heads, head_dim=16, causal=causal,
                               implementation=impl, query_scale_dim=query_scale_dim)


@pytest.mark.parametrize('shape,heads,kv_heads,causal,query_scale_dim', [
    ((4, 2), 8, 8, True, 0), ((8, 1), 8, 8, True, 0), ((1, 8), 8, 8, True, 0),
    ((4, 2), 8, 4, True, 0), ((8, 1), 8, 2, True, 0),  # Grouped-query: 2 or 1 kv head per shard.
    ((4, 2), 8, 8, False, 0), ((1, 8), 8, 8, False, 0),  # Full (bidirectional) attention.
    ((4, 2), 8, 8, True, 64),  # Scores over sqrt(64), not the head size's (Gemma's scalar).
])
def test_splash_equals_xla_with_gradients(shape, heads, kv_heads, causal, query_scale_dim,
                                          devices):
  """Outputs and the gradients of every input and parameter within 1e-5 (float32): the
  batch over 'batch' and heads over 'model' (grouped key/value heads too)."""
  mesh = mesh_lib.make_mesh(shape, ('batch', 'model'), devices)
  x = jax.random.normal(jax.random.key(0), (8, 128, 32))
  weights = jnp.sin(jnp.arange(8 * 128 * 32, dtype=jnp.float32)).reshape(8, 128, 32)
  with sharding.scope(mesh, sharding.standard_rules()):
    params = jax.jit(_attention('xla', heads, kv_heads, causal).init)(jax.random.key(1), x)

    def grads(impl):
      module = _attention(impl, heads, kv_heads, causal, query_scale_dim=query_scale_dim)
      def loss(p, x):
        y = module.apply(p, x)
        return (y * weights).sum(), y
      return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    (_, want), want_grads = grads('xla')
    (_, got), got_grads = grads('splash')
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
  assert max(np.abs(np.asarray(g)).max() for g in jax.tree.leaves(want_grads)) > 0.1


LM = {'mesh.shape': (4, 2), 'model.d_model': 32, 'model.num_heads': 4, 'model.mlp_dim': 64,
      'model.max_len': 128, 'data.seq_len': 128, 'train.batch_size': 8,
      'optimizer.warmup_steps': 0, 'model.positions': 'rotary'}


def test_an_lm_trains_the_same_with_splash(devices):
  """Two steps of a rotary LM: the same losses and gradient norms as XLA's attention."""
  del devices
  xla = trainer('char_lm', **LM)
  with_splash = trainer('char_lm', **LM, **{'model.attention': 'splash'})
  xla.run(2)
  with_splash.run(2)
  for key in ('train/loss', 'train/grad_norm'):
    np.testing.assert_allclose([m[key] for m in with_splash.metrics],
                               [m[key] for m in xla.metrics], rtol=1e-5, err_msg=key)
  with with_splash.scope():  # The step's model FLOPs: the same math, counted through XLA's.
    cost = perf.step_cost(with_splash.setup, with_splash.initial, None)
  assert cost['model_flops'] == cost['lm_analytic_flops']


def test_shapes_it_cannot_take_run_xla_and_say_so_once(devices, caplog):
  """A length that is no multiple of 128 and a decode step: XLA's attention, the same
  numbers, one warning per reason."""
  del devices
  attention._SAID.clear()  # pylint: disable=protected-access
  mesh = mesh_lib.make_mesh((4, 2), ('batch', 'model'))
  x = jax.random.normal(jax.random.key(0), (8, 32, 32))
  with caplog.at_level(logging.WARNING), sharding.scope(mesh, sharding.standard_rules()):
    params = jax.jit(_attention('xla', 8, 8, True).init)(jax.random.key(1), x)
    want = _attention('xla', 8, 8, True).apply(params, x)
    for _ in range(2):
      got = _attention('splash', 8, 8, True).apply(params, x)
  np.testing.assert_array_equal(got, want)
  said = [r.getMessage() for r in caplog.records if 'splash' in r.getMessage()]
  assert said == ["model.attention='splash': lengths 32 and 32 must be multiples of 128; XLA's "
                  'attention runs there instead']


def test_sampling_from_a_splash_model_decodes_with_xla(devices, caplog):
  del devices
  attention._SAID.clear()  # pylint: disable=protected-access
  from zoo.models import decode  # pylint: disable=import-outside-toplevel
  t = trainer('char_lm', **LM, **{'model.attention': 'splash'})
  prompts = np.zeros((8, 4), np.int32)
  with caplog.at_level(logging.WARNING), t.scope():
    fn = lambda m: jax.jit(lambda p: decode.generate_cached(m, p, prompts, np.zeros(8, np.int32),
                                                            8, jax.random.key(0), 0.0))
    got = fn(t.model)(t.initial.params)
    want = fn(t.model.clone(attention='xla'))(t.initial.params)
  np.testing.assert_array_equal(got, want)
  assert any('decoding from a key/value cache' in r.getMessage() for r in caplog.records)


@pytest.mark.skipif(not __import__('importlib').util.find_spec('libtpu'), reason='needs libtpu')
def test_the_tpu_compiler_compiles_the_kernel_into_the_step():
  """On a v5p-8's compile-only devices the train step holds the Pallas kernels (forward
  and backward) as TPU custom calls; with XLA's attention it holds none."""
  devices = topology.devices(topology.parse('v5p-8'))
  texts = {}
  for impl in ('splash', 'xla'):
    config = load_config('char_lm', **{**LM, 'mesh.shape': (4, 1), 'model.attention': impl})
    s = setup_lib.checked(config, devices, plan=True)
    with s.scope():
      texts[impl] = s.jit_train_step().lower(s.abstract_state(), s.batch).compile().as_text()
  assert texts['splash'].count('custom_call_target="tpu_custom_call"') >= 3  # fwd, dq, dkv.
  assert 'tpu_custom_call' not in texts['xla']


@pytest.mark.parametrize('shape,kv_heads', [((1, 4, 2), 2), ((2, 2, 2), 4)])
def test_a_split_sequence_of_balanced_rows_equals_xla_on_one_device(shape, kv_heads, devices,
                                                                    caplog):
  """Context parallelism (batch x context x model): packed rows in the load-balanced order,
  the kernel built for the whole causal mask with its queries' positions sharded; the
  outputs and every gradient within 1e-5 of XLA's attention on one device in natural order.
  Rows not declared balanced (attention.balanced_rows) run XLA's, said once."""
  del devices
  attention._SAID.clear()  # pylint: disable=protected-access
  axes = ('batch', 'context', 'model')
  mesh = mesh_lib.make_mesh(shape, axes)
  rules = sharding.for_mesh(sharding.standard_rules(), axes)
  shards, length = shape[1], 512
  x = jax.random.normal(jax.random.key(0), (2, length, 32))
  weights = jnp.cos(jnp.arange(2 * length * 32, dtype=jnp.float32)).reshape(x.shape)
  segments = np.repeat(np.arange(1, 5), [200, 100, 150, 62])[None].repeat(2, 0).astype(np.int32)
  segments[1] = np.repeat(np.arange(1, 3), [300, 212])
  positions = np.concatenate([np.arange(n) for n in np.unique(segments[0], return_counts=True)[1]])
  positions = np.stack([positions, np.concatenate([np.arange(300), np.arange(212)])])
  order = context.balanced_order(length, shards)
  module = lambda impl: transformer.Attention(num_heads=4, num_kv_heads=kv_heads, head_dim=16,
                                              causal=True, rotary=True, implementation=impl)
  params = jax.jit(module('xla').init)(jax.random.key(1), x)

  def grads(impl, x, weights, positions, segments):
    def loss(p, x):
      y = module(impl).apply(p, x, positions_BL=positions, segments_BL=segments)
      return (y * weights).sum(), y
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
  (_, want), (want_p, want_x) = grads('xla', x, weights, positions, segments)
  fed = (x[:, order], weights[:, order], positions[:, order], segments[:, order])
  with caplog.at_level(logging.WARNING), sharding.scope(mesh, rules):
    with attention.balanced_rows():
      with attention.recording() as chose:
        (_, got), (got_p, got_x) = grads('splash', *fed)
    assert set(chose.values()) == {('splash', '')}
    (_, unbalanced), _ = grads('splash', *fed)
  np.testing.assert_allclose(got, want[:, order], atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(unbalanced, want[:, order], atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(got_x, want_x[:, order], atol=1e-5, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(got_p), jax.tree.leaves(want_p)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
  said = [r.getMessage() for r in caplog.records if 'splash' in r.getMessage()]
  assert said == [f"model.attention='splash': {splash.UNBALANCED}; XLA's attention runs there "
                  'instead']
