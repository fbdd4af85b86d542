"""The language-model loss in chunks of the sequence (model.loss_chunks): the same loss,
gradients, eval sums and scores as from whole logits on every mesh, tied or not, for the
switch sets of the published families (Gemma 2's soft-capped logits too); and the compiled
step's memory no longer grows with the vocabulary beyond the parameters."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import load_config, read_metrics, stop_at
from zoo.models import layers
from zoo.parallel import sharding
from zoo.run import config as cfg
from zoo.run import memory
from zoo.run import setup as setup_lib
from zoo.run import steps, tasks

FAMILIES = {
    'gpt2': {'model.tie_embeddings': True, 'model.use_bias': True},
    'llama': {'model.positions': 'rotary', 'model.norm': 'rms', 'model.mlp_activation': 'swiglu',
              'model.num_kv_heads': 4},
    'gemma2': {'model.positions': 'rotary', 'model.norm': 'rms_offset',
               'model.mlp_activation': 'geglu', 'model.post_norms': True,
               'model.embed_scale': True, 'model.tie_embeddings': True,
               'model.final_softcap': 3.0, 'model.attn_softcap': 50.0},
}


def _setup(mesh, chunks, **overrides):
  config = load_config('char_lm', **{'mesh.shape': mesh, 'model.loss_chunks': chunks,
                                     'model.vocab_size': 300, **overrides})
  return setup_lib.checked(config)


_PLACED = {}   # (mesh, family) -> (Setup, initial state, batch): what several tests take.
_INITIAL = {}  # family -> its initial parameters on the host.


def _placed(mesh, family):
  """The 4-chunk setup of `family` on `mesh`, its initial state and a masked batch. A
  family's parameters are initialised once (each initialisation is a compile) and placed
  on every mesh it is tested on: the comparisons hold for any parameters."""
  if (mesh, family) not in _PLACED:
    s = _setup(mesh, 4, **FAMILIES[family])
    with s.scope():
      if family in _INITIAL:
        params = jax.device_put(_INITIAL[family], s.state_shardings.params)
        state = steps.TrainState(step=0, apply_fn=s.model.apply, params=params, tx=s.optimizer,
                                 opt_state=(), model_state={})
      else:
        state = s.create_state()
        _INITIAL[family] = jax.device_get(state.params)
      _PLACED[mesh, family] = s, state, _batch(s)
  return _PLACED[mesh, family]


def _batch(s):
  size = s.config.train.batch_size
  batch = s.dataset.train_batch(0, size, slice(0, size))
  batch['mask'] = (np.arange(batch['targets'].shape[1]) % 5 != 0).astype(np.float32)[None] \
      * np.ones_like(batch['targets'], np.float32)  # Targets that do not count, as in packing.
  return jax.device_put(batch, s.batch_sharding)


def _reference(s, params, batch):
  """Today's loss: whole float32 logits, then optax's cross-entropy."""
  logits = s.model.apply({'params': params}, batch['inputs'])
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch['targets'])
  return (losses * batch['mask']).sum() / batch['mask'].sum(), logits


@pytest.mark.parametrize('mesh,family', [((8, 1), 'llama'), ((4, 2), 'gpt2'), ((2, 4), 'llama'),
                                         ((4, 2), 'gemma2'), ((4, 2), 'llama')])
def test_chunked_loss_and_gradients_equal_whole_logits(mesh, family, devices):
  """4 chunks of 8 tokens: the loss within 1e-6 and every gradient within float32
  tolerance of whole logits' (the vocabulary split over 'model' on (4,2) and (2,4))."""
  del devices
  s, state, batch = _placed(mesh, family)
  with s.scope():
    chunked = jax.value_and_grad(lambda p: steps.loss(
        p, state, batch, jax.random.key(0), s.task, batch['mask'].sum())[0])
    whole = jax.value_and_grad(lambda p: _reference(s, p, batch)[0])
    # One program for both (a compile each is most of the test's time).
    (got, got_grads), (want, want_grads) = jax.jit(lambda p: (chunked(p), whole(p)))(state.params)
  assert float(got) == pytest.approx(float(want), rel=1e-6)
  for path, a in jax.tree_util.tree_leaves_with_path(got_grads):
    b = dict(jax.tree_util.tree_leaves_with_path(want_grads))[path]
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6, err_msg=jax.tree_util.keystr(path))


def test_eval_sums_and_scores_equal_whole_logits(devices):
  del devices
  s, state, batch = _placed((4, 2), 'llama')
  batch = dict(batch, weights=jnp.ones(s.config.train.batch_size))

  def reference(params):
    """From whole logits: the base task's sums, each row's log-likelihood and greedy match."""
    logits = _reference(s, params, batch)[1]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch['targets'])
    greedy = ((jnp.argmax(logits, -1) == batch['targets']) | (batch['mask'] == 0)).all(-1)
    return tasks.Task().eval_sums(logits, batch), -(losses * batch['mask']).sum(-1), greedy
  with s.scope():  # One program for the three (not one per step, nor per eager op).
    got, got_scores, (want, loglik, greedy) = jax.jit(lambda st: (
        steps.eval_step(st, batch, s.task), steps.score_step(st.params, batch, s.model.apply,
                                                             s.task), reference(st.params)))(state)
  for key in ('loss', 'correct', 'weight'):
    assert float(got[key]) == pytest.approx(float(want[key]), rel=1e-6), key
  np.testing.assert_allclose(got_scores['loglik'], loglik, rtol=1e-6)
  np.testing.assert_array_equal(got_scores['greedy'], greedy)


def test_auto_chunks_by_vocabulary_and_length():
  assert layers.loss_chunks(0, 128, 128) == 1           # char_lm: whole logits, as before.
  assert layers.loss_chunks(0, 1024, 8192) == 2
  assert layers.loss_chunks(0, 8192, 128256) == 256     # 32 tokens x 128,256 <= 2**22.
  assert layers.loss_chunks(0, 7, 2**23) == 7           # Never more chunks than tokens.
  assert layers.loss_chunks(3, 96, 128) == 3


def _peak(vocab, chunks):
  """(the compiled train step's peak per device, the parameters' bytes, the optimizer's) of
  a 1-layer char_lm at `vocab` on (4, 2) (CPU plan: 256 tokens, 8 sequences): the figures
  of `--dry_run`'s plan (plan.make_plan), for the train step alone (the plan also compiles
  the eval step, which this test does not look at)."""
  config = load_config('char_lm', **{
      'mesh.shape': (4, 2), 'model.vocab_size': vocab, 'model.loss_chunks': chunks,
      'model.max_len': 256, 'data.seq_len': 256, 'train.batch_size': 8, 'model.num_layers': 1})
  cfg.validate(config, jax.device_count())
  s = setup_lib.checked(config, plan=True)
  with s.scope():
    state = s.abstract_state()
    train = memory.compile_step(jax.devices()[0].platform, s.jit_train_step(), state, s.batch)
  return (train.memory['peak'], sharding.per_device_bytes(state.params),
          sharding.per_device_bytes(state.opt_state))


def test_the_steps_memory_grows_with_the_vocabulary_only_by_the_parameters(devices):
  """From a 4,096 to a 32,768 vocabulary, the step's peak per device grows by at most the
  state's growth (parameters and AdamW moments, donated) plus twice the parameters' (their
  gradients and an update) and 2 MiB, with the loss in 32 chunks (8 tokens); with whole
  logits (loss_chunks=1) by far more: the test can tell. (Measured: 31.1 MiB against a
  bound of 37.0; whole logits 105.0.)"""
  del devices
  small, small_params, small_opt = _peak(4096, 32)
  big, big_params, big_opt = _peak(32768, 32)
  bound = (big_params + big_opt - small_params - small_opt) + 2 * (big_params - small_params) \
      + 2 * 2**20
  assert big - small <= bound, (big - small, bound)
  whole_small, _, _ = _peak(4096, 1)
  whole_big, _, _ = _peak(32768, 1)
  assert whole_big - whole_small > bound + 32 * 2**20, (whole_big - whole_small, bound)


def test_a_chunked_run_resumes_bit_exactly(tmp_path, monkeypatch, devices):
  """char_lm in 4 loss chunks, stopped (as by SIGTERM) after step 3 and resumed: every
  logged loss equals a straight run's exactly."""
  del devices
  from zoo.run import train  # pylint: disable=import-outside-toplevel
  config = lambda: load_config('char_lm', **{
      'model.loss_chunks': 4, 'train.steps': 8, 'train.log_every_steps': 1,
      'eval.every_steps': 8, 'checkpoint.every_steps': 4, 'checkpoint.async_save': False})
  losses = lambda w: {r['step']: r['train/loss'] for r in read_metrics(w) if 'train/loss' in r}
  train.train_and_evaluate(config(), str(tmp_path / 'straight'))
  stop_at(monkeypatch, 3)
  train.train_and_evaluate(config(), str(tmp_path / 'resumed'))
  monkeypatch.undo()
  train.train_and_evaluate(config(), str(tmp_path / 'resumed'))
  assert losses(tmp_path / 'resumed') == losses(tmp_path / 'straight')
  assert sorted(losses(tmp_path / 'straight')) == list(range(1, 9))


def test_model_flops_count_every_chunk(devices):
  """The step's model FLOPs (MFU's numerator) count the head once per chunk: the analytic
  count, as with whole logits."""
  del devices
  from zoo.run import perf  # pylint: disable=import-outside-toplevel
  s = _setup((4, 2), 4)
  with s.scope():
    cost = perf.step_cost(s, s.abstract_state(), None)
  assert cost['model_flops'] == cost['lm_analytic_flops']
