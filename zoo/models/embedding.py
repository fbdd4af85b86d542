"""Token embedding lookups whose gradient is no contended scatter (`model.embedding_grad`).

The forward pass gathers rows of the table. The gradient of a plain gather (`jnp.take`) is a
scatter-add of every token's cotangent into its row: on a GPU each update is an atomic add,
and real text sends thousands of a batch's tokens into the same few rows (a space, 'e',
'the'), which serialises them. Measured on one H100 (D 2048, 16 x 1024 ids, fwd+bwd, ms;
../shared/GPU.md): take 1.5 with ids spread over 100 rows, 36-72 with Zipf-distributed ids
at any vocabulary; a one-hot matmul 0.3 at V 128, 1.2 at 4k, 8 at 32k, 31 at 128k. In
char_lm:100m the scatter was 26.5 ms of an 84 ms step.

Methods (the gradient; the forward pass is the same gather):
- 'one_hot': one_hot(ids)^T @ cotangents, a matmul accumulated in float32: no scatter,
  cost growing with the vocabulary (2 T V D FLOPs). Best for small vocabularies.
- 'sorted': each sequence's ids sorted, the cotangents of equal ids summed by a segmented
  scan along the sequence, then one scatter-add of those sums: every id at most once per
  sequence, so a row takes at most batch-many adds instead of thousands. For large
  vocabularies on GPUs, where one-hot's FLOPs grow too large.
- 'take': jnp.take's own scatter-add.
- 'auto' (default): 'one_hot' up to ONE_HOT_MAX_VOCAB padded rows, on every backend (a small
  matmul is cheap everywhere and avoids TPU's serial scatter too); above it 'take', which on
  the real 32k-BPE dataset cost no more than one-hot (the whole step gained nothing), and
  whose scatter on TPU and CPU applies updates in turn, without atomics. 'sorted' is there
  for large vocabularies on GPUs whose data has hot rows; `benchmarks/gpu_bench.py
  --zoo_flags=--config.model.embedding_grad=sorted` measures it before it becomes anyone's
  default.

Shapes are suffixed: B batch, L length, D d_model, V padded vocabulary.
"""
import functools

import jax
import jax.numpy as jnp

METHODS = ('auto', 'one_hot', 'sorted', 'take')
# From the H100 figures above: one-hot beats Zipf-distributed scatters by 40x at 4k rows and
# still 5x at 32k, but on a real 32k-BPE dataset the whole step gained nothing (its hot
# rows hold a smaller share): take's scatter above this.
ONE_HOT_MAX_VOCAB = 4096


def method_for(method: str, vocab: int) -> str:
  """The method 'auto' resolves to for a padded vocabulary of `vocab` rows."""
  if method != 'auto':
    return method
  return 'one_hot' if vocab <= ONE_HOT_MAX_VOCAB else 'take'


def lookup(table_VD: jax.Array, ids_BL: jax.Array, method: str) -> jax.Array:
  """table_VD[ids_BL] ([B, L, D]), differentiated by `method` (not 'auto': see method_for)."""
  if method == 'take':
    return jnp.take(table_VD, ids_BL, axis=0)
  return _lookup(table_VD, ids_BL, method)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _lookup(table_VD, ids_BL, method):
  del method
  return jnp.take(table_VD, ids_BL, axis=0)


def _forward(table_VD, ids_BL, method):
  del method
  # The table's shape and dtype travel as a zero-size array: no copy of it is kept.
  return jnp.take(table_VD, ids_BL, axis=0), (ids_BL, jnp.zeros((0,) + table_VD.shape,
                                                                 table_VD.dtype))


def _backward(method, saved, g_BLD):
  ids_BL, like = saved
  vocab, dtype = like.shape[1], like.dtype
  if method == 'one_hot':
    one_hot_BLV = jax.nn.one_hot(ids_BL, vocab, dtype=g_BLD.dtype)
    grad_VD = jnp.einsum('BLV,BLD->VD', one_hot_BLV, g_BLD, preferred_element_type=jnp.float32)
  else:
    grad_VD = _sorted_segment_sums(ids_BL, g_BLD, vocab)
  return grad_VD.astype(dtype), None


def _sorted_segment_sums(ids_BL, g_BLD, vocab):
  """[V, D]: each row's cotangents summed, through per-sequence sorts and segmented scans,
  then a scatter-add of one sum per distinct id and sequence (the others dropped)."""
  order_BL = jnp.argsort(ids_BL, axis=1)
  ids_BL = jnp.take_along_axis(ids_BL, order_BL, axis=1)
  g_BLD = jnp.take_along_axis(g_BLD.astype(jnp.float32), order_BL[..., None], axis=1)
  starts_BL = jnp.concatenate([jnp.ones_like(ids_BL[:, :1], bool),
                               ids_BL[:, 1:] != ids_BL[:, :-1]], axis=1)

  def add(a, b):  # Sums that restart where a segment starts.
    (sum_a, start_a), (sum_b, start_b) = a, b
    return jnp.where(start_b[..., None], sum_b, sum_a + sum_b), start_a | start_b
  sums_BLD, _ = jax.lax.associative_scan(add, (g_BLD, starts_BL), axis=1)
  ends_BL = jnp.concatenate([starts_BL[:, 1:], jnp.ones_like(ids_BL[:, :1], bool)], axis=1)
  rows_BL = jnp.where(ends_BL, ids_BL, vocab)  # Out of range: dropped.
  return jnp.zeros((vocab, g_BLD.shape[-1]), jnp.float32).at[rows_BL].add(sums_BLD, mode='drop')


_lookup.defvjp(_forward, _backward)
