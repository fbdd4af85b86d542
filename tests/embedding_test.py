"""model.embedding_grad: the token embedding's gradient by a one-hot matmul or sorted segment
sums equals jnp.take's scatter-add (float32 tolerance) on every mesh, tied or not; 'auto'
picks by vocabulary; on a GPU target char_lm's train step scatters nothing into the table."""
import importlib.util

import jax
import numpy as np
import pytest

from conftest import load_config
from zoo.models import embedding
from zoo.parallel import topology
from zoo.run import setup as setup_lib
from zoo.run import steps


def _zipf_ids(shape, vocab, seed=0):
  """Ids as text has them: a few rows take most tokens (Zipf), every row possible."""
  rng = np.random.default_rng(seed)
  return np.minimum(rng.zipf(1.3, shape) - 1, vocab - 1).astype(np.int32)


@pytest.mark.parametrize('method', ['one_hot', 'sorted'])
def test_lookup_gradient_equals_takes(method):
  table = jax.random.normal(jax.random.key(0), (384, 16))
  ids = _zipf_ids((4, 64), 300)  # Rows 300-383 (padding) never appear: zero gradient.
  g = jax.random.normal(jax.random.key(1), (4, 64, 16))

  def grad(m):
    return jax.grad(lambda t: (embedding.lookup(t, ids, m) * g).sum())(table)
  want, got = grad('take'), jax.jit(grad, static_argnums=0)(method)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert np.abs(np.asarray(want)).max() > 5  # Hot rows: many tokens summed.
  np.testing.assert_array_equal(np.asarray(
      jax.jit(lambda t: embedding.lookup(t, ids, method))(table)), np.asarray(table)[ids])


def test_auto_picks_by_vocabulary():
  assert embedding.method_for('auto', 128) == 'one_hot'
  assert embedding.method_for('auto', 4096) == 'one_hot'
  assert embedding.method_for('auto', 4224) == 'take'
  assert embedding.method_for('sorted', 128256) == 'sorted'


def _grads(methods, mesh, **overrides):
  """{method: (loss, parameter gradients)} of char_lm's model on `mesh`, each method's
  model from its own config, all at one initial state and batch."""
  out, state = {}, None
  for method in methods:
    config = load_config('char_lm', **{'mesh.shape': mesh, 'model.embedding_grad': method,
                                       **overrides})
    s = setup_lib.checked(config)
    with s.scope():
      if state is None:  # The parameters do not depend on the method: initialised once.
        state = s.create_state()
        batch = s.dataset.train_batch(0, config.train.batch_size,
                                      slice(0, config.train.batch_size))
        batch = jax.device_put(batch, s.batch_sharding)
      with_model = state.replace(apply_fn=s.model.apply)  # This method's model.

      def loss(params, state=with_model, s=s):
        return steps.loss(params, state, batch, jax.random.key(0), s.task,
                          s.task.counted(batch))[0]
      out[method] = jax.jit(jax.value_and_grad(loss))(state.params)
  return out


@pytest.mark.parametrize('mesh,tied', [((8, 1), False), ((4, 2), False), ((4, 2), True)])
def test_the_lm_gradients_equal_takes_on_every_mesh(mesh, tied, devices):
  """One-hot and sorted gradients of char_lm (vocabulary over 'model' on (4, 2); the tied
  head's gradient adds to the table's) within float32 tolerance of take's."""
  del devices
  grads = _grads(('take', 'one_hot', 'sorted'), mesh, **{'model.tie_embeddings': tied})
  want_loss, want = grads['take']
  for method in ('one_hot', 'sorted'):
    loss, got = grads[method]
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-6)
    for path, a, b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(got),
                          jax.tree.leaves(want)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-6, err_msg=f'{method} {path[0]}')
  assert np.abs(np.asarray(want['embed'])).max() > 1e-3


@pytest.mark.skipif(not importlib.util.find_spec('jax_cuda12_plugin'),
                    reason="needs JAX's CUDA plugin ('.[cuda12]') to compile for a GPU target")
def test_the_gpu_compiled_step_scatters_nothing_into_the_table():
  """h100-1 (compile-only): char_lm's step by default holds no scatter into the [128, 64]
  table; with take's gradient it holds one. (The loss's pick of each target's log-probability
  scatters into [B, L, V], one update per position: nothing contends there.)"""
  devices = topology.devices(topology.parse('h100-1'))
  scatters = {}
  for method in ('auto', 'take'):
    config = load_config('char_lm', **{'mesh.shape': (1, 1), 'model.embedding_grad': method,
                                       'model.dtype': 'bfloat16'})
    s = setup_lib.checked(config, devices, plan=True)
    with s.scope():
      text = s.jit_train_step().lower(s.abstract_state(), s.batch).compile().as_text()
    scatters[method] = [line for line in text.splitlines()
                        if ' scatter(' in line and '[128,64]' in line.split(' scatter(')[0]]
  assert not scatters['auto'], scatters['auto'][:3]
  assert scatters['take'], 'the test cannot see a scatter'
