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
"""
import math
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from zoo.models.layers import platform

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


def splits_sequence(spec) -> bool:
  """Whether a spec from `specs` splits the sequence or the head size (no fused kernel here
  takes that)."""
  return spec[1] is not None or spec[3] is not None


def refusal(q_BLNH: jax.Array, k_BMGH: jax.Array, kv_axis: str) -> str:
  """Why the kernel cannot take these queries [B, L, N, H] and keys [B, M, G, H] under the
  current mesh and rules ('' if it can). `kv_axis` is the logical name of the key/value
  heads' activations."""
  batch, length, heads, _ = q_BLNH.shape
  kv_length, kv_heads = k_BMGH.shape[1], k_BMGH.shape[2]
  if length % LANES or kv_length % LANES:
    return f'lengths {length} and {kv_length} must be multiples of {LANES}'
  spec, kv_spec = specs(kv_axis)
  if splits_sequence(spec):
    return SPLIT_SEQUENCE
  batch_shards, head_shards, kv_shards = (_mesh_size(spec[0]), _mesh_size(spec[2]),
                                          _mesh_size(kv_spec[2]))
  if batch % batch_shards or heads % head_shards or kv_heads % kv_shards or (
      kv_shards != head_shards and kv_heads != heads):
    return (f'batch {batch} and heads {heads}/{kv_heads} do not split over their mesh axes '
            f'({batch_shards}, {head_shards}/{kv_shards})')
  return ''


def attention(q_BLNH: jax.Array, k_BMGH: jax.Array, v_BMGH: jax.Array, causal: bool,
              kv_axis: str, segments_BL: Optional[jax.Array] = None) -> jax.Array:
  """Attention of queries [B, L, N, H] over keys and values [B, M, G, H] (causal: query i
  sees keys 0..i; with `segments_BL`, self-attention, only keys of its own segment), in
  the splash kernel, for shapes it takes (`refusal` is ''). `kv_axis` is the logical name
  of the key/value heads' activations."""
  _, length, heads, head_dim = q_BLNH.shape
  kv_length = k_BMGH.shape[1]
  spec, kv_spec = specs(kv_axis)
  head_shards = _mesh_size(spec[2])
  # Imported here: the kernel's modules cost every zoo process ~70 ms to import.
  from jax.experimental.pallas.ops.tpu import splash_attention  # pylint: disable=import-outside-toplevel
  kernel_lib = splash_attention.splash_attention_kernel
  mask_lib = splash_attention.splash_attention_mask
  # Off TPU (the tests, on CPU) Pallas interprets the kernel.
  interpret = platform() != 'tpu'
  blocks = kernel_lib.BlockSizes(
      block_q=_block(length), block_kv=_block(kv_length), block_kv_compute=_block(kv_length),
      block_q_dkv=_block(length), block_kv_dkv=_block(kv_length),
      block_kv_dkv_compute=_block(kv_length), block_q_dq=_block(length),
      block_kv_dq=_block(kv_length))
  local_heads = heads // head_shards

  def one_shard(q_BNLH, k_BGMH, v_BGMH, *segments):
    shape = (length, kv_length)
    mask = mask_lib.CausalMask(shape) if causal else mask_lib.FullMask(shape)
    splash = kernel_lib.make_splash_mha(mask_lib.MultiHeadMask([mask] * local_heads),
                                        block_sizes=blocks, head_shards=1, q_seq_shards=1,
                                        interpret=interpret)
    if not segments:
      return jax.vmap(splash)(q_BNLH, k_BGMH, v_BGMH)
    ids = kernel_lib.SegmentIds(q=segments[0], kv=segments[0])
    return jax.vmap(lambda q, k, v, s: splash(q, k, v, segment_ids=s))(q_BNLH, k_BGMH, v_BGMH,
                                                                        ids)

  scale = 1.0 / math.sqrt(head_dim)
  q_BNLH = (q_BLNH.astype(jnp.float32) * scale).astype(q_BLNH.dtype).transpose(0, 2, 1, 3)
  k_BGMH, v_BGMH = k_BMGH.transpose(0, 2, 1, 3), v_BMGH.transpose(0, 2, 1, 3)
  P = jax.sharding.PartitionSpec  # pylint: disable=invalid-name
  in_specs = (P(spec[0], spec[2]), P(kv_spec[0], kv_spec[2]), P(kv_spec[0], kv_spec[2]))
  args = (q_BNLH, k_BGMH, v_BGMH)
  if segments_BL is not None:
    in_specs, args = in_specs + (P(spec[0]),), args + (segments_BL.astype(jnp.int32),)
  out_BNLH = jax.shard_map(one_shard, in_specs=in_specs, out_specs=P(spec[0], spec[2]),
                           check_vma=False)(*args)
  return out_BNLH.transpose(0, 2, 1, 3)

