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
  arXiv:2104.09864: rotates queries and keys in self-attention, no parameters).

Shapes are suffixed: B batch, L (M) query (key) length, D d_model, H heads, K head
size, F MLP units. Parameters are our own einsum weights rather than nn.DenseGeneral:
flax issue #3676 breaks 3-D kernels with logical partitioning under a mesh.

The families subclass `Transformer`, which declares these switches and the sizes once
(their `config.model` keys), and check them with `check_config`.
"""
from typing import Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from zoo.errors import fail
from zoo.models.layers import param, partitioned

REMAT_POLICIES = {
    'none': None,
    'full': jax.checkpoint_policies.nothing_saveable,  # Recompute the whole block.
    'dots': jax.checkpoint_policies.checkpoint_dots,
    'dots_no_batch': jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}
DTYPES = ('float32', 'bfloat16')
POSITIONS = ('learned', 'rotary')


class Transformer(nn.Module):
  """The sizes and switches of every Transformer family; subclasses add their own fields
  (declared with `kw_only=True`) and a `__call__`."""
  num_layers: int
  d_model: int
  num_heads: int
  mlp_dim: int
  scan_layers: bool = False
  remat: str = 'none'
  dtype: str = 'float32'
  dropout_rate: float = 0.0


def check_config(m: ml_collections.ConfigDict) -> None:
  """The Transformer families' sizes and switches (config.model)."""
  if m.d_model % m.num_heads:
    fail('model.num_heads', f'{m.num_heads} does not divide model.d_model={m.d_model}')
  choices = {'remat': tuple(REMAT_POLICIES), 'dtype': DTYPES, 'positions': POSITIONS}
  for key, known in choices.items():
    if key in m and m[key] not in known:
      fail(f'model.{key}', f'unknown {key} {m[key]!r}; known: {", ".join(known)}')
  if m.get('positions') == 'rotary' and (m.d_model // m.num_heads) % 2:
    fail('model.positions', f'rotary positions need an even head size, got '
         f'd_model/num_heads = {m.d_model // m.num_heads}')
  if not 0 <= m.get('dropout_rate', 0.0) < 1:
    fail('model.dropout_rate', f'must be in [0, 1), got {m.dropout_rate}')


def check_lengths(m: ml_collections.ConfigDict, inputs: Sequence[np.ndarray]) -> None:
  """model.max_len covers the longest token sequence among the model's inputs [B, L]."""
  needed = max(x.shape[1] for x in inputs)
  if m.max_len < needed:
    fail('model.max_len', f'{m.max_len} is shorter than the {needed} positions of the data')


def layer_norm(name: str, dtype: str) -> nn.LayerNorm:
  return nn.LayerNorm(name=name, dtype=dtype,
                      scale_init=partitioned(nn.initializers.ones_init(), ('embed',)),
                      bias_init=partitioned(nn.initializers.zeros_init(), ('embed',)))


def rotate(x_BLHK: jax.Array) -> jax.Array:
  """Rotary position embedding: pairs of features turn by position-dependent angles."""
  half = x_BLHK.shape[-1] // 2
  freq_K = 1.0 / (10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
  angle_LK = jnp.arange(x_BLHK.shape[1], dtype=jnp.float32)[:, None] * freq_K
  cos, sin = jnp.cos(angle_LK)[:, None], jnp.sin(angle_LK)[:, None]  # [L, 1, K/2]
  x1, x2 = jnp.split(x_BLHK.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x_BLHK.dtype)


class Attention(nn.Module):
  """Multi-head attention: self-attention, or cross-attention to `context_BMD`."""
  num_heads: int
  head_dim: int
  causal: bool = False
  rotary: bool = False
  dtype: str = 'float32'

  @nn.compact
  def __call__(self, x_BLD, context_BMD=None):
    kv_BMD = x_BLD if context_BMD is None else context_BMD
    d_model = x_BLD.shape[-1]
    shape, axes = (d_model, self.num_heads, self.head_dim), ('embed', 'heads', 'kv')
    act = ('act_batch', 'act_len', 'act_heads', 'act_kv')
    project = lambda name, y: nn.with_logical_constraint(
        jnp.einsum('BLD,DHK->BLHK', y, param(self, name, shape, axes, self.dtype)), act)
    q_BLHK = project('query', x_BLD)
    k_BMHK, v_BMHK = project('key', kv_BMD), project('value', kv_BMD)
    if self.rotary:
      q_BLHK, k_BMHK = rotate(q_BLHK), rotate(k_BMHK)
    logits_BHLM = jnp.einsum('BLHK,BMHK->BHLM', q_BLHK, k_BMHK, preferred_element_type=jnp.float32)
    logits_BHLM = logits_BHLM / jnp.sqrt(self.head_dim).astype(jnp.float32)
    if self.causal:
      length = x_BLD.shape[1]
      logits_BHLM = jnp.where(jnp.tril(jnp.ones((length, length), bool)), logits_BHLM, -1e30)
    probs_BHLM = jax.nn.softmax(logits_BHLM, axis=-1).astype(v_BMHK.dtype)
    out_BLHK = nn.with_logical_constraint(jnp.einsum('BHLM,BMHK->BLHK', probs_BHLM, v_BMHK), act)
    w_out = param(self, 'out', (self.num_heads, self.head_dim, d_model), ('heads', 'kv', 'embed'),
                  self.dtype)
    return jnp.einsum('BLHK,HKD->BLD', out_BLHK, w_out)


class MlpBlock(nn.Module):
  """Two-layer GELU MLP; the hidden units are split over 'model'."""
  mlp_dim: int
  dtype: str = 'float32'

  @nn.compact
  def __call__(self, x_BLD):
    d_model = x_BLD.shape[-1]
    wi = param(self, 'wi', (d_model, self.mlp_dim), ('embed', 'mlp'), self.dtype)
    h_BLF = nn.with_logical_constraint(nn.gelu(jnp.einsum('BLD,DF->BLF', x_BLD, wi)),
                                       ('act_batch', 'act_len', 'act_mlp'))
    wo = param(self, 'wo', (self.mlp_dim, d_model), ('mlp', 'embed'), self.dtype)
    return jnp.einsum('BLF,FD->BLD', h_BLF, wo)


class Block(nn.Module):
  """Pre-norm residual block: self-attention, optional cross-attention, MLP.

  Returns (x, None) so that the same block runs unrolled or as the body of `nn.scan`.
  """
  num_heads: int
  mlp_dim: int
  causal: bool = False
  cross: bool = False
  rotary: bool = False
  dtype: str = 'float32'
  dropout_rate: float = 0.0
  deterministic: bool = True

  @nn.compact
  def __call__(self, x_BLD, context_BMD=None):
    head_dim = x_BLD.shape[-1] // self.num_heads
    drop = lambda y: nn.Dropout(self.dropout_rate)(y, deterministic=self.deterministic)
    x_BLD = x_BLD + drop(Attention(self.num_heads, head_dim, self.causal, self.rotary, self.dtype,
                                   name='attn')(layer_norm('ln_attn', self.dtype)(x_BLD)))
    if self.cross:
      x_BLD = x_BLD + drop(Attention(self.num_heads, head_dim, dtype=self.dtype, name='cross_attn')(
          layer_norm('ln_cross', self.dtype)(x_BLD), context_BMD))
    x_BLD = x_BLD + drop(MlpBlock(self.mlp_dim, self.dtype, name='mlp')(
        layer_norm('ln_mlp', self.dtype)(x_BLD)))
    return nn.with_logical_constraint(x_BLD, ('act_batch', 'act_len', 'act_embed')), None


def blocks(module: Transformer, x_BLD: jax.Array, context_BMD: Optional[jax.Array] = None, *,
           prefix: str, train: bool, causal: bool = False, cross: bool = False,
           rotary: bool = False) -> jax.Array:
  """Runs `module.num_layers` Blocks, unrolled (`{prefix}_{i}`) or under nn.scan (`{prefix}s`).

  Call inside the `nn.compact` method of a Transformer `module`: the blocks become its
  submodules, sized and switched by its fields.
  """
  cls = Block
  policy = REMAT_POLICIES[module.remat]
  if policy is not None:
    # Under scan, the loop already keeps XLA from merging the recomputation away.
    cls = nn.remat(Block, policy=policy, prevent_cse=not module.scan_layers)
  fields = dict(num_heads=module.num_heads, mlp_dim=module.mlp_dim, causal=causal, cross=cross,
                rotary=rotary, dtype=module.dtype, dropout_rate=module.dropout_rate,
                deterministic=not train)
  if module.scan_layers:
    stack = nn.scan(cls, variable_axes={'params': 0}, split_rngs={'params': True, 'dropout': True},
                    in_axes=(nn.broadcast,), length=module.num_layers,
                    metadata_params={nn.PARTITION_NAME: 'layers'})
    x_BLD, _ = stack(**fields, name=f'{prefix}s')(x_BLD, context_BMD)
    return x_BLD
  for i in range(module.num_layers):
    x_BLD, _ = cls(**fields, name=f'{prefix}_{i}')(x_BLD, context_BMD)
  return x_BLD


def embed_positions(module: nn.Module, x_BLD: jax.Array, positions: str, max_len: int, name: str,
                    train: bool) -> jax.Array:
  """Adds a learned position table ('learned'; rotary positions act inside attention), then
  dropout; the result is pinned to the activation layout of a block's input."""
  if positions != 'rotary':
    pos_LD = param(module, name, (max_len, x_BLD.shape[-1]), ('len', 'embed'), module.dtype)
    x_BLD = x_BLD + pos_LD[:x_BLD.shape[1]]
  x_BLD = nn.Dropout(module.dropout_rate)(x_BLD, deterministic=not train)
  return nn.with_logical_constraint(x_BLD, ('act_batch', 'act_len', 'act_embed'))
