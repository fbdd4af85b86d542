"""Splash attention (`model.attention='splash'`): JAX's Pallas TPU kernel for block-sparse
attention (jax.experimental.pallas.ops.tpu.splash_attention), which never materialises the
L x L scores that XLA's attention keeps: at 8,192 tokens a 1B-parameter step on v5p-64
needs 16.2 GiB per chip instead of 29.0.

The kernel attends within one example's heads, so it runs under `jax.shard_map` over the
mesh axes that the logical rules give the batch and head dimensions, vmapped over the
local batch. It does not scale queries: they are scaled by 1/sqrt(head size) first.
Grouped-query attention maps query head n to key/value head n // (heads / kv heads), as
jax.nn.dot_product_attention does. Off TPU it runs in Pallas's interpret mode (slow, for
tests). `refusal` says which shapes it cannot take (lengths that are no multiple of 128, a
batch or heads that do not divide over their mesh axes): zoo.models.attention runs XLA's
attention there and the log says so.

A sequence split over the mesh (context parallelism): each device holds its queries' rows
in the load-balanced order (zoo.parallel.context: chunks i and 2 x shards - 1 - i) and the
keys and values gathered whole. The kernel is built once for the whole [L, L] causal mask
with `q_seq_shards` = the shards, its queries' positions (`q_sequence`) in that order, and
shard_map hands each device its slice of the mask's block tables (`manual_sharding_spec`);
each device all-gathers the keys, values and segment ids inside shard_map (so the backward
pass reduce-scatters their gradients) and puts them back in natural order, so the kernel
skips the blocks that a query chunk cannot see. The kernel trusts that order: it
runs only where the caller says the rows were fed so (`balanced`: a language model's train
and eval steps, whose batches Setup.arrange permutes); any other split runs XLA's
attention, whose masks follow the tokens' positions.
"""
import math
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from zoo.models.layers import platform
from zoo.parallel import context

LANES = 128          # The kernel's blocks are multiples of this along both lengths.
MAX_BLOCK = 512      # Larger blocks, fewer grid steps (MaxText's default for long contexts).


def _block(length: int) -> int:
  return math.gcd(length, MAX_BLOCK)


def _mesh_size(entry) -> int:
  mesh = jax.sharding.get_abstract_mesh()
  axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
  return math.prod(mesh.shape[a] for a in axes)


def specs(kv_axis: str) -> tuple:
  """The mesh axes of the queries' [B, L, N, H] and the keys' and values' [B, M, G, H]
  activations under the current rules; `kv_axis` is the key/value heads' logical name."""
  return (nn.logical_to_mesh_axes(('act_batch', 'act_len', 'act_heads', 'act_kv')),
          nn.logical_to_mesh_axes(('act_batch', 'act_len', kv_axis, 'act_kv')))


SPLIT_SEQUENCE = 'the rules split the sequence or the head size over the mesh'
UNBALANCED = ("the rules split the sequence and these rows are not fed in the load-balanced "
              "order (only a language model's train and eval steps are)")


def splits_sequence(spec) -> bool:
  """Whether a spec from `specs` splits the sequence or the head size (cuDNN's partitioner
  takes neither)."""
  return spec[1] is not None or spec[3] is not None


def refusal(q_BLNH: jax.Array, k_BMGH: jax.Array, kv_axis: str, causal: bool = True,
            balanced: bool = False) -> str:
  """Why the kernel cannot take these queries [B, L, N, H] and keys [B, M, G, H] under the
  current mesh and rules ('' if it can). `kv_axis` is the logical name of the key/value
  heads' activations. A split sequence needs causal self-attention on rows fed in the
  load-balanced order (`balanced`)."""
  batch, length, heads, _ = q_BLNH.shape
  kv_length, kv_heads = k_BMGH.shape[1], k_BMGH.shape[2]
  if length % LANES or kv_length % LANES:
    return f'lengths {length} and {kv_length} must be multiples of {LANES}'
  spec, kv_spec = specs(kv_axis)
  shards = _mesh_size(spec[1])
  if spec[3] is not None:
    return 'the rules split the head size over the mesh'
  if shards > 1:
    if not causal or kv_length != length:
      return 'the rules split the sequence of attention that is not causal self-attention'
    if not balanced:
      return UNBALANCED
    if length % (shards * LANES):
      return (f'the rules split the sequence of {length} positions into {shards} shards, '
              f'which must be multiples of {LANES}')
  batch_shards, head_shards, kv_shards = (_mesh_size(spec[0]), _mesh_size(spec[2]),
                                          _mesh_size(kv_spec[2]))
  if batch % batch_shards or heads % head_shards or kv_heads % kv_shards or (
      kv_shards != head_shards and kv_heads != heads):
    return (f'batch {batch} and heads {heads}/{kv_heads} do not split over their mesh axes '
            f'({batch_shards}, {head_shards}/{kv_shards})')
  return ''


def _mask(length: int, kv_length: int, causal: bool, shards: int, heads: int):
  """The kernel's mask of `heads` heads: causal or full; with `shards` > 1, causal over the
  queries held in the load-balanced order (each query row's position is `q_sequence`'s)."""
  # Imported here: the kernel's modules cost every zoo process ~70 ms to import.
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib  # pylint: disable=import-outside-toplevel
  shape = (length, kv_length)
  if not causal:
    mask = mask_lib.FullMask(shape)
  else:
    mask = mask_lib.CausalMask(shape)
    if shards > 1:  # The kernel reads each query's position from q_sequence, its slice each.
      mask.q_sequence = context.balanced_order(length, shards).astype('int32')
  return mask_lib.MultiHeadMask([mask] * heads)


def attention(q_BLNH: jax.Array, k_BMGH: jax.Array, v_BMGH: jax.Array, causal: bool,
              kv_axis: str, segments_BL: Optional[jax.Array] = None,
              scale: Optional[float] = None) -> jax.Array:
  """Attention of queries [B, L, N, H] over keys and values [B, M, G, H] (causal: query i
  sees keys 0..i; with `segments_BL`, self-attention, only keys of its own segment), in
  the splash kernel, for shapes it takes (`refusal` is ''). `kv_axis` is the logical name
  of the key/value heads' activations. Under a split sequence the rows are in the
  load-balanced order and the keys and values gathered whole (zoo.models.attention).
  Scores are scaled by `scale` (default 1/sqrt(head size))."""
  _, length, heads, head_dim = q_BLNH.shape
  kv_length = k_BMGH.shape[1]
  spec, kv_spec = specs(kv_axis)
  head_shards, shards = _mesh_size(spec[2]), _mesh_size(spec[1])
  from jax.experimental.pallas.ops.tpu import splash_attention  # pylint: disable=import-outside-toplevel
  kernel_lib = splash_attention.splash_attention_kernel
  # Off TPU (the tests, on CPU) Pallas interprets the kernel.
  interpret = platform() != 'tpu'
  # A query block within one load-balanced chunk where the chunks allow (a block across two
  # is exact too, but skips fewer keys).
  chunk = length // (2 * shards)
  q_block = _block(chunk if shards > 1 and chunk % LANES == 0 else length // shards)
  kv_block = _block(kv_length)
  blocks = kernel_lib.BlockSizes(
      block_q=q_block, block_kv=kv_block, block_kv_compute=kv_block, block_q_dkv=q_block,
      block_kv_dkv=kv_block, block_kv_dkv_compute=kv_block, block_q_dq=q_block,
      block_kv_dq=kv_block)
  kernel = kernel_lib.make_splash_mha(_mask(length, kv_length, causal, shards, heads),
                                      block_sizes=blocks, head_shards=head_shards,
                                      q_seq_shards=shards, interpret=interpret)
  P = jax.sharding.PartitionSpec  # pylint: disable=invalid-name
  kernel_spec = kernel.manual_sharding_spec(jax.sharding.NamedSharding(
      jax.sharding.get_abstract_mesh(), P(spec[2], spec[1])))
  def whole(x, axis):  # This shard's keys gathered over the sequence's mesh axes, in order.
    # Gathered here, inside shard_map: the backward pass reduce-scatters their gradients.
    return x if shards == 1 else context.natural_order(
        jax.lax.all_gather(x, spec[1], axis=axis, tiled=True), shards, axis)

  def one_shard(kernel, q_BNLH, k_BGMH, v_BGMH, *segments):
    k_BGMH, v_BGMH = whole(k_BGMH, 2), whole(v_BGMH, 2)
    if not segments:
      return jax.vmap(kernel)(q_BNLH, k_BGMH, v_BGMH)
    q_segments, = segments
    kv_segments = whole(q_segments, 1)
    ids = kernel_lib.SegmentIds(q=q_segments, kv=kv_segments)
    return jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=s))(q_BNLH, k_BGMH, v_BGMH,
                                                                        ids)

  scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
  q_BNLH = (q_BLNH.astype(jnp.float32) * scale).astype(q_BLNH.dtype).transpose(0, 2, 1, 3)
  k_BGMH, v_BGMH = k_BMGH.transpose(0, 2, 1, 3), v_BMGH.transpose(0, 2, 1, 3)
  q_spec, kv_in = P(spec[0], spec[2], spec[1]), P(kv_spec[0], kv_spec[2], spec[1])
  in_specs = (kernel_spec, q_spec, kv_in, kv_in)
  args = (kernel, q_BNLH, k_BGMH, v_BGMH)
  if segments_BL is not None:
    in_specs, args = in_specs + (P(spec[0], spec[1]),), args + (segments_BL.astype(jnp.int32),)
  out_BNLH = jax.shard_map(one_shard, in_specs=in_specs, out_specs=q_spec,
                           check_vma=False)(*args)
  return out_BNLH.transpose(0, 2, 1, 3)
