"""Packed documents (data.windows='documents'): the plan tiles a split and splits only long
documents, a token sees only its own document in every attention implementation, a packed
batch's per-document losses are each document's alone, and the loss is the mean over the
targets that count, across microbatches."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import trainer
from zoo import data
from zoo.data import packing, tokens
from zoo.data import tokenizer as tokenizer_lib

SEQ = 32
# Documents of every kind: shorter than a window, exactly one, longer than several.
LENGTHS = [5, 40, 3, 31, 12, 100, 7, 32, 9, 1, 64, 18, 2, 33, 20, 6, 70, 11, 4, 25] * 3


@pytest.fixture(scope='module')
def packed_dir(tmp_path_factory):
  """A byte-level token dataset of documents of LENGTHS characters (+ their EOS)."""
  root = tmp_path_factory.mktemp('packed')
  rng = np.random.default_rng(0)
  docs = [''.join(rng.choice(list('abcdefghij .'), n)) for n in LENGTHS]
  with open(root / 'docs.jsonl', 'w', encoding='utf-8') as f:
    f.writelines(json.dumps({'text': d}) + '\n' for d in docs)
  (root / 'data').mkdir()
  tokens.prepare([str(root / 'docs.jsonl')], str(root / 'data'), tokenizer_lib.bytes_tokenizer(),
                 val_fraction=0.2)
  return str(root / 'data')


def test_the_plan_tiles_the_targets_and_splits_only_long_documents():
  ends = np.cumsum(np.array(LENGTHS) + 1)  # With each one's EOS.
  starts = packing.plan(ends, SEQ)
  lengths = np.diff(starts)
  assert starts[0] == 0 and starts[-1] == ends[-1] and np.all((lengths > 0) & (lengths <= SEQ))
  begins = np.concatenate([[0], ends[:-1]])
  for begin, end in zip(begins, ends):
    cut = (starts > begin) & (starts < end)  # Window starts inside the document.
    if end - begin <= SEQ:
      assert not cut.any(), (begin, end)   # A document that fits a window is never split.
    else:
      assert cut.any()
  for w in np.flatnonzero(lengths < SEQ)[:-1]:  # Padding only before a document that did not fit.
    following = ends[np.searchsorted(begins, starts[w + 1])] - starts[w + 1]
    assert starts[w + 1] in begins and SEQ - lengths[w] < following <= SEQ
  assert 0 < packing.padding(starts, SEQ) < 0.3


def test_epochs_are_permutations_and_batches_cross_them_whole():
  """Positions across several epochs: each epoch visits every window once, its order drawn
  from (seed, epoch); a batch that straddles two epochs takes the end of one and the start
  of the next, and any grouping of the positions (rows per process, resumed steps) reads
  the same windows."""
  order = packing.EpochOrder(13, (7,))
  seen = order(np.arange(13 * 4))
  for epoch in range(4):
    assert sorted(seen[13 * epoch:13 * (epoch + 1)]) == list(range(13))
  assert not np.array_equal(seen[:13], seen[13:26])  # Each epoch its own permutation.
  again = packing.EpochOrder(13, (7,))  # A resumed run: a fresh order, later positions first.
  for start in (40, 9, 26, 0):  # A batch of 5 crossing the first and the third boundary.
    np.testing.assert_array_equal(again(np.arange(start, start + 5)), seen[start:start + 5])
  np.testing.assert_array_equal(again(np.arange(13 * 4)[1::2]), seen[1::2])  # One process's rows.
  assert not np.array_equal(packing.EpochOrder(13, (8,))(np.arange(13)), seen[:13])


def test_windows_carry_segments_positions_and_a_mask(packed_dir):
  """Inputs are the stream shifted by one (a document's first input is the EOS before it),
  segments count documents from 1, positions restart at each, padding is masked."""
  config = trainer_config(packed_dir)
  dataset = data.load(config.data, 0)
  batch = dataset.train_batch(0, 64, slice(None))
  eos = 256
  for row in range(64):
    seg, pos, mask = batch['segments'][row], batch['positions'][row], batch['mask'][row]
    n = int(mask.sum())
    assert np.all(mask[:n] == 1) and np.all(mask[n:] == 0) and np.all(seg[n:] == 0)
    np.testing.assert_array_equal(batch['inputs'][row, 1:n], batch['targets'][row, :n - 1])
    new = np.flatnonzero(np.diff(seg[:n])) + 1  # Where each later segment starts.
    assert np.all(np.diff(seg[:n]) >= 0) and seg[0] == 1
    assert np.all(batch['inputs'][row, new] == eos) and np.all(pos[new] == 0) and pos[0] == 0
    assert np.all(batch['targets'][row, new - 1] == eos)  # The previous document's end.
  assert 0 < 1 - batch['mask'].mean() < 0.3


def trainer_config(path, **overrides):
  from conftest import load_config  # pylint: disable=import-outside-toplevel
  return load_config('char_lm', **{'data.name': 'tokens', 'data.path': path, 'data.seq_len': SEQ,
                                   'model.max_len': SEQ, 'mesh.shape': (4, 2), **overrides})


def _packed_lm(path, **overrides):
  return trainer('char_lm', **{'data.name': 'tokens', 'data.path': path, 'data.seq_len': SEQ,
                               'model.max_len': SEQ, 'mesh.shape': (4, 2), 'model.d_model': 32,
                               'model.num_heads': 4, 'model.mlp_dim': 64, 'train.batch_size': 16,
                               'optimizer.warmup_steps': 0, **overrides})


@pytest.mark.parametrize('positions', ['learned', 'rotary'])
def test_packed_per_document_losses_equal_each_document_alone(packed_dir, positions, devices):
  """Every segment's summed loss in packed rows, against the same tokens run alone as a
  sequence of their own from position 0: within 1e-5 (float32)."""
  del devices
  t = _packed_lm(packed_dir, **{'model.positions': positions})
  batch = t.dataset.train_batch(0, 16, slice(None))
  params = t.initial.params

  def token_losses(inputs, targets, **kwargs):
    logits = t.model.apply({'params': params}, jnp.asarray(inputs), **kwargs)
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), jnp.asarray(targets)[..., None], -1)[..., 0]
  with t.scope():  # And without segments: a row's later documents see the earlier ones.
    packed, crossed = map(np.asarray, jax.jit(lambda b: (token_losses(
        b['inputs'], b['targets'], segments_BL=b['segments'], positions_BL=b['positions']),
        token_losses(b['inputs'], b['targets'])))(batch))
  alone_fn = jax.jit(token_losses)  # One document per row from position 0, zeros after it
  compared = 0                      # (which a causal model does not see).
  for row in range(len(batch['inputs'])):
    for segment in range(1, batch['segments'][row].max() + 1):
      where = batch['segments'][row] == segment
      inputs, targets = np.zeros((2, 1, SEQ), np.int32)
      inputs[0, :where.sum()] = batch['inputs'][row][where]
      targets[0, :where.sum()] = batch['targets'][row][where]
      alone = np.asarray(alone_fn(inputs, targets))[0, :where.sum()]
      np.testing.assert_allclose(packed[row][where].sum(), alone.sum(), rtol=1e-5, atol=1e-5)
      compared += 1
  assert compared > 16 * 1.5  # Rows hold several documents.
  assert np.abs(crossed - packed)[batch['segments'] > 1].max() > 1e-3


@pytest.mark.parametrize('attention', ['xla', 'splash'])
def test_a_token_sees_only_its_own_document(attention, devices):
  """Changing one document of a window changes no output of the others (splash: the
  kernel's segment ids, interpreted on CPU)."""
  del devices
  t = trainer('char_lm', **{'mesh.shape': (4, 2), 'model.d_model': 32, 'model.num_heads': 4,
                            'model.mlp_dim': 64, 'model.max_len': 128, 'data.seq_len': 128,
                            'train.batch_size': 8, 'model.positions': 'rotary',
                            'model.attention': attention})
  rng = np.random.default_rng(1)
  tokens_BL = rng.integers(0, 50, (8, 128)).astype(np.int32)
  segments_BL = np.repeat(np.array([[1] * 40 + [2] * 50 + [3] * 38]), 8, 0).astype(np.int32)
  positions_BL = np.concatenate([np.arange(40), np.arange(50), np.arange(38)])[None].repeat(8, 0)
  changed = tokens_BL.copy()
  changed[:, 40:90] = rng.integers(0, 50, (8, 50))  # Document 2, everywhere.
  apply = jax.jit(lambda x, s: t.model.apply({'params': t.initial.params}, x, segments_BL=s,
                                             positions_BL=positions_BL))
  with t.scope():
    a, b = np.asarray(apply(tokens_BL, segments_BL)), np.asarray(apply(changed, segments_BL))
    ones = np.ones_like(segments_BL)
    crossed_a, crossed_b = np.asarray(apply(tokens_BL, ones)), np.asarray(apply(changed, ones))
  others = segments_BL != 2
  np.testing.assert_allclose(a[others], b[others], atol=1e-6, rtol=0)
  assert np.abs(a[~others] - b[~others]).max() > 1e-3
  assert np.abs(crossed_a[:, 90:] - crossed_b[:, 90:]).max() > 1e-3  # One segment: it leaks.


PLAIN_SGD = {'optimizer.name': 'sgd', 'optimizer.learning_rate': 1.0, 'optimizer.momentum': 0.0,
             'optimizer.schedule': 'constant', 'optimizer.warmup_steps': 0,
             'optimizer.weight_decay': 0.0, 'optimizer.grad_clip_norm': 0.0}


def test_the_loss_is_the_mean_over_counted_targets_across_microbatches(packed_dir, devices):
  """The step's loss is sum(loss * mask) / sum(mask) over the global batch, its update
  minus that loss's gradient (plain SGD), and 4 microbatches (each with its own share of
  padding) give the same gradient as one."""
  del devices
  big = _packed_lm(packed_dir, **PLAIN_SGD)
  accumulated = _packed_lm(packed_dir, **PLAIN_SGD, **{'train.microbatches': 4})
  big.run(1)
  accumulated.run(1)
  batch = big.dataset.train_batch(0, 16, slice(None))
  shares = batch['mask'].reshape(4, 4, -1).swapaxes(0, 1).reshape(4, -1).sum(1)
  assert len(set(shares.tolist())) > 1  # The microbatches' padding differs.
  def reference(params):
    """The mean over counted targets, from whole logits."""
    logits = big.model.apply({'params': params}, batch['inputs'], segments_BL=batch['segments'],
                             positions_BL=batch['positions'])
    losses = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch['targets'][..., None],
                                  -1)[..., 0]
    return (losses * batch['mask']).sum() / batch['mask'].sum()
  with big.scope():
    want, grads = jax.jit(jax.value_and_grad(reference))(big.initial.params)
  assert big.metrics[0]['train/loss'] == pytest.approx(float(want), rel=1e-5)
  # Plain SGD at rate 1: the step moved every parameter by exactly minus its gradient.
  for new, old, grad in zip(*(jax.tree.leaves(t) for t in (big.state.params, big.initial.params,
                                                           grads))):
    np.testing.assert_allclose(new, np.asarray(old) - np.asarray(grad), rtol=1e-4, atol=1e-6)
  assert big.metrics[0]['train/padding'] == pytest.approx(1 - batch['mask'].mean(), rel=1e-5)
  for a, b in zip(jax.tree.leaves(accumulated.state.params), jax.tree.leaves(big.state.params)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  assert accumulated.metrics[0]['train/loss'] == pytest.approx(float(want), rel=1e-5)


@pytest.mark.skipif(not __import__('importlib').util.find_spec('jax_cuda12_plugin'),
                    reason="needs JAX's CUDA plugin ('.[cuda12]') to compile for a GPU target")
def test_cudnn_compiles_the_segment_mask_into_its_fused_attention(packed_dir):
  """On an H100 target (compile only), packed windows take cuDNN's fused attention with
  the segment mask as its bias; stream windows take it without one."""
  from conftest import load_config  # pylint: disable=import-outside-toplevel
  from zoo.parallel import topology  # pylint: disable=import-outside-toplevel
  from zoo.run import setup as setup_lib  # pylint: disable=import-outside-toplevel
  devices = topology.devices(topology.parse('h100-8'))
  targets = {}
  for windows in ('documents', 'stream'):
    config = load_config('char_lm', **{'data.name': 'tokens', 'data.path': packed_dir,
                                       'data.windows': windows, 'model.attention': 'cudnn',
                                       'model.dtype': 'bfloat16', 'mesh.shape': (8, 1)})
    s = setup_lib.checked(config, devices, plan=True)
    with s.scope():
      text = s.jit_train_step().lower(s.abstract_state(), s.batch).compile().as_text()
    targets[windows] = {line.split('custom_call_target="')[1].split('"')[0]
                        for line in text.splitlines() if 'custom_call_target="__cudnn$fmha' in line}
  assert targets['documents'] == {'__cudnn$fmhaScaleBiasSoftmax',
                                  '__cudnn$fmhaScaleBiasSoftmaxBackward'}, targets
  assert targets['stream'] == {'__cudnn$fmhaSoftmax', '__cudnn$fmhaSoftmaxBackward'}, targets
