"""Transformer layers and fields shared by the LM, the encoder-decoder and the ViT.

Pre-norm blocks (Radford et al., 2019) with heads and MLP units split over the 'model'
mesh axis (Megatron-LM, arXiv:1909.08053). The switches every Transformer family takes:

- `scan_layers`: the blocks run under `nn.scan`, their parameters stacked along a
  leading 'layers' logical axis: one block is compiled, however deep the model;
- `remat`: recompute activations in the backward pass: 'full' (everything), 'dots' (all
  but matmul outputs), 'dots_no_batch' (all but the outputs of matmuls without batch
  dimensions: the weight projections are kept, the attention einsums recomputed);
- `dtype`: the computation dtype ('bfloat16' or 'float32'); parameters stay float32;
  attention logits and vocabulary logits accumulate in float32, and softmax,
  normalisation statistics and the loss run in float32;
- `dropout_rate`: dropout on the embeddings and each residual branch, keyed per step;
- `positions`: 'learned' (a table of max_len rows) or 'rotary' (RoFormer, Su et al.,
  arXiv:2104.09864: rotates queries and keys in self-attention, no parameters), with
  `rope_theta` its base;
- the switches that published architectures differ by: `num_kv_heads` < num_heads is
  grouped-query attention (Ainslie et al., arXiv:2305.13245; keys and values are never
  repeated), `head_dim`, `norm` ('layer': LayerNorm with bias, or 'rms': RMSNorm) and
  `norm_epsilon`, `mlp_activation` ('gelu' with the tanh approximation, 'gelu_exact', or
  'swiglu': SiLU-gated, Shazeer arXiv:2002.05202), `use_bias` (biases on every projection);
  GPT-2, Llama and HF's ViT are settings of these (zoo/convert.py);
- `attention`: 'xla' or 'cudnn' (fused, on NVIDIA GPUs), jax.nn.dot_product_attention's
  implementations, or 'splash', the Pallas TPU kernel that never holds the L x L scores
  (zoo.models.splash; interpreted off TPU). Each takes segment ids: packed documents
  (zoo.data.packing) attend only within themselves.

With `decode=True` a model keeps a key/value cache of `max_len` positions in the 'cache'
collection, sharded over heads like the activations, and appends to it: a prompt's
prefill, then one token per call (zoo.models.decode).

Shapes are suffixed: B batch, L (M) query (key) length, D d_model, N heads, G key/value
heads, H head size, F MLP units, S cache positions. Parameters are our own einsum
weights rather than nn.DenseGeneral: flax issue #3676 breaks 3-D kernels with logical
partitioning under a mesh.

The families subclass `Transformer`, which declares these switches and the sizes once
(their `config.model` keys), and check them with `check_config`.
"""
import dataclasses
from typing import Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from zoo.errors import fail
from zoo.models import splash
from zoo.models.layers import param, partitioned

REMAT_POLICIES = {
    'none': None,
    'full': jax.checkpoint_policies.nothing_saveable,  # Recompute the whole block.
    'dots': jax.checkpoint_policies.checkpoint_dots,
    'dots_no_batch': jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}
DTYPES = ('float32', 'bfloat16')
POSITIONS = ('learned', 'rotary')
NORMS = ('layer', 'rms')
MLP_ACTIVATIONS = ('gelu', 'gelu_exact', 'swiglu')
ATTENTION = ('xla', 'cudnn', 'splash')


class Transformer(nn.Module):
  """The sizes and switches of every Transformer family; subclasses add their own fields
  (declared with `kw_only=True`) and a `__call__`. The defaults are zoo's own layout."""
  num_layers: int
  d_model: int
  num_heads: int
  mlp_dim: int
  num_kv_heads: int = 0          # 0: num_heads (multi-head attention).
  head_dim: int = 0              # 0: d_model // num_heads.
  norm: str = 'layer'
  norm_epsilon: float = 1e-6
  mlp_activation: str = 'gelu'
  use_bias: bool = False
  rope_theta: float = 10000.0
  attention: str = 'xla'
  scan_layers: bool = False
  remat: str = 'none'
  dtype: str = 'float32'
  dropout_rate: float = 0.0
  decode: bool = False           # Keep and extend a key/value cache (zoo.models.decode).

  @property
  def kv_heads(self) -> int:
    return self.num_kv_heads or self.num_heads

  @property
  def head_size(self) -> int:
    return self.head_dim or self.d_model // self.num_heads


def check_config(m: ml_collections.ConfigDict) -> None:
  """The Transformer families' sizes and switches (config.model)."""
  if not m.get('head_dim') and m.d_model % m.num_heads:
    fail('model.num_heads', f'{m.num_heads} does not divide model.d_model={m.d_model}')
  if m.get('num_kv_heads') and m.num_heads % m.num_kv_heads:
    fail('model.num_kv_heads', f'{m.num_kv_heads} does not divide model.num_heads='
         f'{m.num_heads}; grouped-query attention needs whole groups')
  choices = {'remat': tuple(REMAT_POLICIES), 'dtype': DTYPES, 'positions': POSITIONS,
             'norm': NORMS, 'mlp_activation': MLP_ACTIVATIONS, 'attention': ATTENTION}
  for key, known in choices.items():
    if key in m and m[key] not in known:
      fail(f'model.{key}', f'unknown {key} {m[key]!r}; known: {", ".join(known)}')
  head = m.get('head_dim') or m.d_model // m.num_heads
  if m.get('positions') == 'rotary' and head % 2:
    fail('model.positions', f'rotary positions need an even head size, got '
         f'd_model/num_heads = {head}' if not m.get('head_dim') else
         f'rotary positions need an even head size, got model.head_dim = {head}')
  if not 0 <= m.get('dropout_rate', 0.0) < 1:
    fail('model.dropout_rate', f'must be in [0, 1), got {m.dropout_rate}')
  for key in ('norm_epsilon', 'rope_theta'):
    if key in m and not m[key] > 0:
      fail(f'model.{key}', f'must be positive, got {m[key]}')


def check_lengths(m: ml_collections.ConfigDict, inputs: Sequence[np.ndarray]) -> None:
  """model.max_len covers the longest token sequence among the model's inputs [B, L]."""
  needed = max(x.shape[1] for x in inputs)
  if m.max_len < needed:
    fail('model.max_len', f'{m.max_len} is shorter than the {needed} positions of the data')


@dataclasses.dataclass(frozen=True)
class Spec:
  """A Transformer's sizes and switches as a plain value, for its blocks (a module field
  that is itself a Module would become a submodule)."""
  num_heads: int
  kv_heads: int
  head_size: int
  mlp_dim: int
  norm: str
  norm_epsilon: float
  mlp_activation: str
  use_bias: bool
  rope_theta: float
  attention: str
  dtype: str
  dropout_rate: float
  decode: bool

  @classmethod
  def of(cls, module: Transformer) -> 'Spec':
    return cls(**{f.name: getattr(module, f.name) for f in dataclasses.fields(cls)})


def norm(module: 'Transformer | Spec', name: str) -> nn.Module:
  """The module's normalisation layer: LayerNorm (scale and bias) or RMSNorm (scale)."""
  scale = partitioned(nn.initializers.ones_init(), ('embed',))
  if module.norm == 'rms':
    return nn.RMSNorm(name=name, dtype=module.dtype, epsilon=module.norm_epsilon, scale_init=scale)
  return nn.LayerNorm(name=name, dtype=module.dtype, epsilon=module.norm_epsilon, scale_init=scale,
                      bias_init=partitioned(nn.initializers.zeros_init(), ('embed',)))


def rotate(x_BLNH: jax.Array, positions_BL: jax.Array, theta: float = 10000.0) -> jax.Array:
  """Rotary position embedding: pairs of features (i, i + H/2) turn by the angle
  position / theta^(2i/H), Hugging Face's `rotate_half` layout."""
  half = x_BLNH.shape[-1] // 2
  freq_H = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))
  angle_BLH = positions_BL.astype(jnp.float32)[..., None] * freq_H
  cos, sin = jnp.cos(angle_BLH)[:, :, None], jnp.sin(angle_BLH)[:, :, None]  # [B, L, 1, H/2]
  x1, x2 = jnp.split(x_BLNH.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x_BLNH.dtype)


class Attention(nn.Module):
  """Multi-head or grouped-query attention: self-attention, or cross-attention to
  `context_BMD`, through jax.nn.dot_product_attention."""
  num_heads: int
  num_kv_heads: int
  head_dim: int
  causal: bool = False
  rotary: bool = False
  rope_theta: float = 10000.0
  use_bias: bool = False
  implementation: str = 'xla'
  dtype: str = 'float32'
  decode: bool = False
  cache_length: int = 0

  def _project(self, name, y_BLD, heads, axes, act):
    w_DNH = param(self, name, (y_BLD.shape[-1], heads, self.head_dim), axes, self.dtype)
    y_BLNH = jnp.einsum('BLD,DNH->BLNH', y_BLD, w_DNH)
    if self.use_bias:
      y_BLNH = y_BLNH + param(self, f'{name}_bias', (heads, self.head_dim), axes[1:], self.dtype,
                              nn.initializers.zeros_init())
    return nn.with_logical_constraint(y_BLNH, act)

  @nn.compact
  def __call__(self, x_BLD: jax.Array, context_BMD: Optional[jax.Array] = None,
               positions_BL: Optional[jax.Array] = None,
               start_B: Optional[jax.Array] = None,
               segments_BL: Optional[jax.Array] = None) -> jax.Array:
    """`segments_BL` (self-attention): a query sees only keys of its own segment (packed
    documents, zoo.data.packing)."""
    kv_BMD = x_BLD if context_BMD is None else context_BMD
    d_model = x_BLD.shape[-1]
    grouped = self.num_kv_heads != self.num_heads
    act = ('act_batch', 'act_len', 'act_heads', 'act_kv')
    kv_act = ('act_batch', 'act_len', 'act_kv_heads' if grouped else 'act_heads', 'act_kv')
    kv_axes = ('embed', 'kv_heads' if grouped else 'heads', 'kv')
    q_BLNH = self._project('query', x_BLD, self.num_heads, ('embed', 'heads', 'kv'), act)
    k_BMGH = self._project('key', kv_BMD, self.num_kv_heads, kv_axes, kv_act)
    v_BMGH = self._project('value', kv_BMD, self.num_kv_heads, kv_axes, kv_act)
    if positions_BL is None:
      positions_BL = jnp.broadcast_to(jnp.arange(x_BLD.shape[1]), x_BLD.shape[:2])
    if self.rotary:
      q_BLNH = rotate(q_BLNH, positions_BL, self.rope_theta)
      k_BMGH = rotate(k_BMGH, positions_BL, self.rope_theta)
    mask, causal, out_BLNH = None, self.causal, None
    if self.decode:
      k_BMGH, v_BMGH, mask = self._extend_cache(k_BMGH, v_BMGH, start_B, kv_act)
      causal = False  # The cache mask is causal.
    elif segments_BL is not None:
      mask = (segments_BL[:, :, None] == segments_BL[:, None, :])[:, None]  # [B, 1, L, M]
    if self.implementation == 'splash' and not self.is_initializing():  # Init: shapes only.
      if self.decode:
        splash.fallback('decoding from a key/value cache')
      else:
        out_BLNH = splash.attention(q_BLNH, k_BMGH, v_BMGH, causal, kv_act[2], segments_BL)
    if out_BLNH is None:
      out_BLNH = jax.nn.dot_product_attention(
          q_BLNH, k_BMGH, v_BMGH, mask=mask, is_causal=causal,
          implementation=None if self.implementation == 'splash' else self.implementation)
    out_BLNH = nn.with_logical_constraint(out_BLNH, act)
    w_NHD = param(self, 'out', (self.num_heads, self.head_dim, d_model), ('heads', 'kv', 'embed'),
                  self.dtype)
    out_BLD = jnp.einsum('BLNH,NHD->BLD', out_BLNH, w_NHD)
    if self.use_bias:
      out_BLD = out_BLD + param(self, 'out_bias', (d_model,), ('embed',), self.dtype,
                                nn.initializers.zeros_init())
    return out_BLD

  def _extend_cache(self, k_BLGH, v_BLGH, start_B, kv_act):
    """Writes this call's keys and values at the cache's next positions; returns the whole
    cache and the mask [B, 1, L, S]: a query sees its row's positions from start_B (left
    padding before it) up to its own."""
    batch, length = k_BLGH.shape[:2]
    shape = (batch, self.cache_length, self.num_kv_heads, self.head_dim)
    cached_k = self.variable('cache', 'key', jnp.zeros, shape, k_BLGH.dtype)
    cached_v = self.variable('cache', 'value', jnp.zeros, shape, v_BLGH.dtype)
    index = self.variable('cache', 'index', lambda: jnp.zeros((), jnp.int32))
    i = index.value
    cached_k.value = nn.with_logical_constraint(
        jax.lax.dynamic_update_slice(cached_k.value, k_BLGH, (0, i, 0, 0)), kv_act)
    cached_v.value = nn.with_logical_constraint(
        jax.lax.dynamic_update_slice(cached_v.value, v_BLGH, (0, i, 0, 0)), kv_act)
    index.value = i + length
    if start_B is None:
      start_B = jnp.zeros((batch,), jnp.int32)
    slots_S = jnp.arange(self.cache_length)
    query_L = i + jnp.arange(length)
    mask_BLS = (slots_S[None, None, :] <= query_L[None, :, None]) & (
        slots_S[None, None, :] >= start_B[:, None, None])
    return cached_k.value, cached_v.value, mask_BLS[:, None]


class MlpBlock(nn.Module):
  """Two-layer MLP (GELU) or SiLU-gated one (SwiGLU); the hidden units are split over 'model'."""
  mlp_dim: int
  activation: str = 'gelu'
  use_bias: bool = False
  dtype: str = 'float32'

  @nn.compact
  def __call__(self, x_BLD: jax.Array) -> jax.Array:
    d_model = x_BLD.shape[-1]
    dense = lambda name, y, w_shape, axes: jnp.einsum(
        'BLD,DF->BLF', y, param(self, name, w_shape, axes, self.dtype))
    if self.activation == 'swiglu':
      gate_BLF = dense('wi_gate', x_BLD, (d_model, self.mlp_dim), ('embed', 'mlp'))
      h_BLF = nn.silu(gate_BLF) * dense('wi_up', x_BLD, (d_model, self.mlp_dim), ('embed', 'mlp'))
    else:
      h_BLF = dense('wi', x_BLD, (d_model, self.mlp_dim), ('embed', 'mlp'))
      if self.use_bias:
        h_BLF = h_BLF + param(self, 'wi_bias', (self.mlp_dim,), ('mlp',), self.dtype,
                              nn.initializers.zeros_init())
      h_BLF = nn.gelu(h_BLF, approximate=self.activation == 'gelu')
    h_BLF = nn.with_logical_constraint(h_BLF, ('act_batch', 'act_len', 'act_mlp'))
    out_BLD = dense('wo', h_BLF, (self.mlp_dim, d_model), ('mlp', 'embed'))
    if self.use_bias:
      out_BLD = out_BLD + param(self, 'wo_bias', (d_model,), ('embed',), self.dtype,
                                nn.initializers.zeros_init())
    return out_BLD


class Block(nn.Module):
  """Pre-norm residual block: self-attention, optional cross-attention, MLP.

  Returns (x, None) so that the same block runs unrolled or as the body of `nn.scan`.
  """
  spec: Spec                 # The family's sizes and switches.
  causal: bool = False
  cross: bool = False
  rotary: bool = False
  cache_length: int = 0
  deterministic: bool = True

  @nn.compact
  def __call__(self, x_BLD: jax.Array, context_BMD: Optional[jax.Array] = None,
               positions_BL: Optional[jax.Array] = None,
               start_B: Optional[jax.Array] = None,
               segments_BL: Optional[jax.Array] = None) -> tuple[jax.Array, None]:
    s = self.spec
    drop = lambda y: nn.Dropout(s.dropout_rate)(y, deterministic=self.deterministic)
    attention = dict(num_heads=s.num_heads, head_dim=s.head_size, use_bias=s.use_bias,
                     implementation=s.attention, dtype=s.dtype)
    x_BLD = x_BLD + drop(Attention(
        num_kv_heads=s.kv_heads, causal=self.causal, rotary=self.rotary, rope_theta=s.rope_theta,
        decode=s.decode, cache_length=self.cache_length, **attention, name='attn')(
            norm(s, 'ln_attn')(x_BLD), None, positions_BL, start_B, segments_BL))
    if self.cross:
      x_BLD = x_BLD + drop(Attention(num_kv_heads=s.num_heads, **attention, name='cross_attn')(
          norm(s, 'ln_cross')(x_BLD), context_BMD))
    x_BLD = x_BLD + drop(MlpBlock(s.mlp_dim, s.mlp_activation, s.use_bias, s.dtype, name='mlp')(
        norm(s, 'ln_mlp')(x_BLD)))
    return nn.with_logical_constraint(x_BLD, ('act_batch', 'act_len', 'act_embed')), None


def blocks(module: Transformer, x_BLD: jax.Array, context_BMD: Optional[jax.Array] = None, *,
           prefix: str, train: bool, causal: bool = False, cross: bool = False,
           rotary: bool = False, positions_BL: Optional[jax.Array] = None,
           start_B: Optional[jax.Array] = None, segments_BL: Optional[jax.Array] = None,
           cache_length: int = 0) -> jax.Array:
  """Runs `module.num_layers` Blocks, unrolled (`{prefix}_{i}`) or under nn.scan (`{prefix}s`).

  Call inside the `nn.compact` method of a Transformer `module`: the blocks become its
  submodules, sized and switched by its fields.
  """
  cls = Block
  policy = REMAT_POLICIES[module.remat]
  if policy is not None:
    # Under scan, the loop already keeps XLA from merging the recomputation away.
    cls = nn.remat(Block, policy=policy, prevent_cse=not module.scan_layers)
  fields = dict(spec=Spec.of(module), causal=causal, cross=cross, rotary=rotary,
                cache_length=cache_length, deterministic=not train)
  extra = (context_BMD, positions_BL, start_B, segments_BL)  # The same for every block.
  if module.scan_layers:
    stack = nn.scan(cls, variable_axes={'params': 0, 'cache': 0},
                    split_rngs={'params': True, 'dropout': True},
                    in_axes=(nn.broadcast,) * len(extra), length=module.num_layers,
                    metadata_params={nn.PARTITION_NAME: 'layers'})
    x_BLD, _ = stack(**fields, name=f'{prefix}s')(x_BLD, *extra)
    return x_BLD
  for i in range(module.num_layers):
    x_BLD, _ = cls(**fields, name=f'{prefix}_{i}')(x_BLD, *extra)
  return x_BLD


def embed_positions(module: Transformer, x_BLD: jax.Array, positions: str, max_len: int,
                    name: str, train: bool, positions_BL: Optional[jax.Array] = None) -> jax.Array:
  """Adds a learned position table ('learned'; rotary positions act inside attention), then
  dropout; the result is pinned to the activation layout of a block's input. A decoding
  model passes each token's position (`positions_BL`)."""
  if positions != 'rotary':
    pos_LD = param(module, name, (max_len, x_BLD.shape[-1]), ('len', 'embed'), module.dtype)
    x_BLD = x_BLD + (pos_LD[:x_BLD.shape[1]] if positions_BL is None else
                     jnp.take(pos_LD, positions_BL, axis=0))
  x_BLD = nn.Dropout(module.dropout_rate)(x_BLD, deterministic=not train)
  return nn.with_logical_constraint(x_BLD, ('act_batch', 'act_len', 'act_embed'))
