"""Pieces every model family shares: named parameters, Dense layers, image inputs, vocabularies.

Model code names parameter axes with logical names (see zoo.parallel.sharding); these helpers
attach them, so a family file never spells out `nn.with_logical_partitioning` itself.
"""
from typing import Any, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

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


def _head(module: nn.Module, d_model: int, vocab_size: int, dtype: Any,
          embed_VD: Optional[jax.Array]) -> jax.Array:
  """The output head [D, V]: a 'head' parameter, or tied, the embedding table transposed."""
  if embed_VD is None:
    return param(module, 'head', (d_model, padded_vocab_size(vocab_size)), ('embed', 'vocab'),
                 dtype)
  return embed_VD.T


def _logits(x_BLD: jax.Array, head_DV: jax.Array, vocab_size: int, softcap: float) -> jax.Array:
  logits_BLV = jnp.einsum('BLD,DV->BLV', x_BLD, head_DV, preferred_element_type=jnp.float32)
  logits_BLV = nn.with_logical_constraint(logits_BLV, ('act_batch', 'act_len', 'act_vocab'))
  if softcap:
    logits_BLV = softcap * jnp.tanh(logits_BLV / softcap)
  return jnp.where(jnp.arange(head_DV.shape[1]) < vocab_size, logits_BLV, -1e30)


def vocab_logits(module: nn.Module, x_BLD: jax.Array, vocab_size: int, dtype: Any,
                 embed_VD: Optional[jax.Array] = None, softcap: float = 0.0) -> jax.Array:
  """Float32 logits over the padded vocabulary, by a 'head' [D, V] or, tied, the embedding
  table `embed_VD`, soft-capped to (-softcap, softcap) if given (Gemma 2); padding ids get
  -1e30 (never sampled)."""
  head_DV = _head(module, x_BLD.shape[-1], vocab_size, dtype, embed_VD)
  return _logits(x_BLD, head_DV, vocab_size, softcap)


# Auto chunking keeps one chunk's logits at most this many per sequence (16 MiB in float32):
# under it a sequence's logits are computed whole, as before chunking existed.
LOSS_CHUNK_ELEMENTS = 2**22


def loss_chunks(chunks: int, length: int, vocab: int) -> int:
  """How many chunks of the sequence the loss computes logits for in turn: `chunks` if
  given (>= 1), else the fewest that divide `length` and hold at most LOSS_CHUNK_ELEMENTS
  logits of the padded vocabulary per sequence."""
  if chunks:
    return chunks
  return next(n for n in range(1, length + 1)
              if length % n == 0 and (length // n) * vocab <= LOSS_CHUNK_ELEMENTS
              or n == length)


def token_losses(module: nn.Module, x_BLD: jax.Array, targets_BL: jax.Array, vocab_size: int,
                 dtype: Any, embed_VD: Optional[jax.Array] = None, softcap: float = 0.0,
                 chunks: int = 0, temperature: float = 1.0, entropy: bool = False) -> dict:
  """Each target's cross-entropy [B, L] (float32), whether it is the likeliest token
  [B, L] and, with `entropy`, the entropy of the distribution it is drawn from [B, L]
  (logged, not differentiated), from the final hidden states, without a [B, L, V] logits
  array: the sequence is cut into `loss_chunks(chunks, L, V)` chunks, whose logits
  (vocab_logits's, soft cap and padding ids included) are computed in turn under lax.map
  and, in the backward pass, recomputed from the chunk's hidden states (jax.checkpoint):
  one chunk's logits are live at a time. `temperature` divides the logits first (what a
  policy sampled at that temperature is scored with)."""
  batch, length, d_model = x_BLD.shape
  head_DV = _head(module, d_model, vocab_size, dtype, embed_VD)
  n = loss_chunks(chunks, length, head_DV.shape[1])
  if length % n:
    raise ValueError(f'model.loss_chunks={n} does not divide the sequence length {length}')

  def chunk(head32_DV, xs):
    x_BCD, t_BC = xs
    logits_BCV = _logits(x_BCD, head32_DV.astype(dtype), vocab_size, softcap)
    if temperature != 1.0:
      logits_BCV = logits_BCV / temperature
    losses_BC = optax.softmax_cross_entropy_with_integer_labels(logits_BCV, t_BC)
    out = {'loss': losses_BC, 'correct': jnp.argmax(logits_BCV, axis=-1) == t_BC}
    if entropy:
      logp_BCV = jax.nn.log_softmax(jax.lax.stop_gradient(logits_BCV), axis=-1)
      out['entropy'] = -jnp.sum(jnp.exp(logp_BCV) * logp_BCV, axis=-1)
    return out
  if n == 1:  # The whole sequence's logits at once, kept for the backward pass.
    return chunk(head_DV, (x_BLD, targets_BL))
  chunk = jax.checkpoint(chunk)

  # Chunk j holds positions j, j + n, j + 2n, ...: strided, so that where the sequence is
  # split over devices (context parallelism) every chunk is split the same way and each
  # device computes its own positions' logits (contiguous chunks would each live on one
  # device, and the loop would gather the hidden states).
  def split(y):  # [B, L, ...] -> [n, B, L/n, ...]
    return jnp.moveaxis(y.reshape((batch, length // n, n) + y.shape[2:]), 2, 0)
  # The head's gradient sums over chunks in float32 (it is closed over in float32).
  head32_DV = head_DV.astype(jnp.float32)
  chunked = jax.lax.map(lambda xs: chunk(head32_DV, xs), (split(x_BLD), split(targets_BL)))
  return jax.tree.map(lambda y: jnp.moveaxis(y, 0, 2).reshape(batch, length), chunked)


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
