"""Pieces every model family shares: named parameters, Dense layers, image inputs, vocabularies.

Model code names parameter axes with logical names (see zoo.parallel.sharding); these helpers
attach them, so a family file never spells out `nn.with_logical_partitioning` itself.
"""
from typing import Any, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

VOCAB_MULTIPLE = 128  # Pad vocabularies so that they split evenly over a 'model' axis.
_normal = nn.initializers.normal(stddev=0.02)


def partitioned(init: nn.initializers.Initializer, axes: Sequence) -> nn.initializers.Initializer:
  """`init` whose parameters carry the logical axis names `axes`."""
  return nn.with_logical_partitioning(init, tuple(axes))


def dense(features: int, axes: Sequence, name: str,
          kernel_init: nn.initializers.Initializer = nn.initializers.lecun_normal(),
          **kwargs) -> nn.Dense:
  """A Dense layer whose kernel has logical axes `axes` (in, out) and its bias `axes[1:]`."""
  return nn.Dense(features, name=name, kernel_init=partitioned(kernel_init, axes),
                  bias_init=partitioned(nn.initializers.zeros_init(), axes[1:]), **kwargs)


def other_axis(axis: str) -> str:
  """Megatron's alternation: a layer whose input axis is 'embed' outputs 'mlp' units (split
  over 'model'), and the next one maps 'mlp' back to 'embed', so a pair needs one all-reduce."""
  return 'mlp' if axis == 'embed' else 'embed'


def images(x: jax.Array) -> jax.Array:
  """Images [B, H, W] or [B, H, W, C] as float32 [B, H, W, C]."""
  x_BHWC = x.astype(jnp.float32)
  return x_BHWC[..., None] if x_BHWC.ndim == 3 else x_BHWC


def param(module: nn.Module, name: str, shape: Sequence[int], axes: Sequence, dtype: Any,
          init: nn.initializers.Initializer = _normal) -> jax.Array:
  """A float32 parameter with logical axis names, cast to the computation dtype."""
  return module.param(name, partitioned(init, axes), shape).astype(dtype)


def platform() -> str:
  """The platform a step is traced for: the current mesh's devices' (compile-only pod
  devices too), else JAX's default backend. Kernels are chosen by it."""
  device = getattr(jax.sharding.get_abstract_mesh(), 'abstract_device', None)
  return device.platform if device is not None else jax.default_backend()


def padded_vocab_size(vocab_size: int) -> int:
  return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def embedding_table(module: nn.Module, vocab_size: int, d_model: int, dtype: Any) -> jax.Array:
  """The token embedding table [padded vocab, D], logical axes (vocab, embed)."""
  return param(module, 'embed', (padded_vocab_size(vocab_size), d_model), ('vocab', 'embed'), dtype)


def vocab_logits(module: nn.Module, x_BLD: jax.Array, vocab_size: int, dtype: Any,
                 embed_VD: Optional[jax.Array] = None, softcap: float = 0.0) -> jax.Array:
  """Float32 logits over the padded vocabulary, by a 'head' [D, V] or, tied, the embedding
  table `embed_VD`, soft-capped to (-softcap, softcap) if given (Gemma 2); padding ids get
  -1e30 (never sampled)."""
  vocab = padded_vocab_size(vocab_size)
  if embed_VD is None:
    head_DV = param(module, 'head', (x_BLD.shape[-1], vocab), ('embed', 'vocab'), dtype)
    logits_BLV = jnp.einsum('BLD,DV->BLV', x_BLD, head_DV, preferred_element_type=jnp.float32)
  else:
    logits_BLV = jnp.einsum('BLD,VD->BLV', x_BLD, embed_VD, preferred_element_type=jnp.float32)
  logits_BLV = nn.with_logical_constraint(logits_BLV, ('act_batch', 'act_len', 'act_vocab'))
  if softcap:
    logits_BLV = softcap * jnp.tanh(logits_BLV / softcap)
  return jnp.where(jnp.arange(vocab) < vocab_size, logits_BLV, -1e30)


NORMS = ('layer', 'rms', 'rms_offset')


class OffsetRMSNorm(nn.Module):
  """RMSNorm scaled by (1 + scale), scale starting at 0 (Gemma's), in float32."""
  epsilon: float
  dtype: Any
  axes: tuple = ('embed',)

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    scale = self.param('scale', partitioned(nn.initializers.zeros_init(), self.axes),
                       (x.shape[-1],))
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.epsilon)
    return (y * (1.0 + scale.astype(jnp.float32))).astype(self.dtype)


def norm(kind: str, epsilon: float, dtype: Any, name: str, axes: Sequence = ('embed',)
         ) -> nn.Module:
  """A normalisation layer over the last axis (logical `axes`): 'layer' (LayerNorm, scale
  and bias), 'rms' (RMSNorm, scale) or 'rms_offset' (RMSNorm by 1 + scale)."""
  axes = tuple(axes)
  scale = partitioned(nn.initializers.ones_init(), axes)
  if kind == 'rms':
    return nn.RMSNorm(name=name, dtype=dtype, epsilon=epsilon, scale_init=scale)
  if kind == 'rms_offset':
    return OffsetRMSNorm(epsilon, dtype, axes, name=name)
  return nn.LayerNorm(name=name, dtype=dtype, epsilon=epsilon, scale_init=scale,
                      bias_init=partitioned(nn.initializers.zeros_init(), axes))
