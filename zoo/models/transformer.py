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
  `qkv_bias` (biases on queries, keys and values only: Qwen2), `qk_norm` (each head's
  queries and keys normalised: Qwen3, Gemma 3), norm 'rms_offset' (RMSNorm by 1 + scale:
  Gemma), mlp_activation 'geglu' (tanh-GELU-gated: Gemma), `post_norms` (each branch's
  output normalised too: Gemma 2, 3), `embed_scale` (embeddings times sqrt(d_model):
  Gemma), `query_scale_dim` (scores scaled by its inverse square root), `attn_softcap` and
  `final_softcap` (Gemma 2), `sliding_window` with `global_every` (local layers: Mistral,
  Gemma 2, 3; zoo.models.attention), `rope_scaling` 'linear', 'llama3' or 'yarn' with its
  factors (zoo.models.rope), and `rope_local_theta` (local layers' own rotary base: Gemma 3); GPT-2, Llama,
  Mistral, Qwen2/3, Gemma 1-3 and HF's ViT are settings of these (zoo.hf.layouts);
- `lora`: low-rank adapters on the projections it names (zoo.models.lora);
- routed experts in place of the MLPs (`transformer_lm`'s `num_experts` and friends,
  zoo.models.moe), a gated shared expert beside them (Qwen2-MoE), dense layers among them;
- `embedding_grad`: how the token embedding's gradient is summed: 'auto' (the default),
  'one_hot', 'sorted' or 'take' (zoo.models.embedding: no contended scatter on GPUs);
- `attention`: 'auto' (the default: cuDNN's fused kernel on NVIDIA GPUs, splash on TPUs,
  XLA's elsewhere, each layer falling back to XLA's where its kernel cannot take it),
  'xla' or 'cudnn', jax.nn.dot_product_attention's implementations, or 'splash', the Pallas
  TPU kernel that never holds the L x L scores (zoo.models.splash; interpreted off TPU; no
  sliding windows or soft caps); zoo.models.attention. Each takes segment ids: packed
  documents (zoo.data.packing) attend only within themselves.

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
from zoo.models import embedding
from zoo.models import lora as lora_lib
from zoo.models import moe as moe_lib
from zoo.models import quantize
from zoo.models import rope as rope_lib
from zoo.models.attention import IMPLEMENTATIONS, Attention
from zoo.models.layers import NORMS, norm as norm_layer, param

REMAT_POLICIES = {
    'none': None,
    'full': jax.checkpoint_policies.nothing_saveable,  # Recompute the whole block.
    'dots': jax.checkpoint_policies.checkpoint_dots,
    'dots_no_batch': jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}
DTYPES = ('float32', 'bfloat16')
POSITIONS = ('learned', 'rotary')
MLP_ACTIVATIONS = ('gelu', 'gelu_exact', 'swiglu', 'geglu')


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
  rope_scaling: str = 'none'     # 'linear', 'llama3' or 'yarn': the global layers' frequencies.
  rope_factor: float = 1.0
  rope_low_freq_factor: float = 1.0   # llama3's ramp, over wavelengths of
  rope_high_freq_factor: float = 4.0  # rope_original_max_len / these.
  rope_original_max_len: int = 0
  rope_beta_fast: float = 32.0   # yarn: the ramp's ends, in rotations over
  rope_beta_slow: float = 1.0    # rope_original_max_len.
  rope_attention_factor: float = 0.0  # yarn: rotated queries' and keys' scale; 0: 0.1 ln(f) + 1.
  rope_local_theta: float = 0.0  # Local layers' own base, unscaled (Gemma 3); 0: as global.
  qkv_bias: bool = False
  qk_norm: bool = False
  post_norms: bool = False
  embed_scale: bool = False
  query_scale_dim: int = 0       # 0: head size.
  attn_softcap: float = 0.0      # 0: none.
  final_softcap: float = 0.0     # 0: none.
  sliding_window: int = 0        # 0: every layer global.
  global_every: int = 0          # With a window: layer i is global iff (i + 1) % this == 0.
  lora: lora_lib.Lora = lora_lib.Lora()
  # Low-precision matmuls (zoo.models.quantize): 'int8' or 'fp8', on the block projections
  # whose parameter path one of quantize_modules' regular expressions matches.
  quantization: str = 'none'
  quantize_modules: tuple = ('.*',)
  attention: str = 'auto'
  embedding_grad: str = 'auto'   # The token embedding's gradient (zoo.models.embedding).
  scan_layers: bool = False
  remat: str = 'none'
  dtype: str = 'float32'
  dropout_rate: float = 0.0
  decode: bool = False           # Keep and extend a key/value cache (zoo.models.decode).
  cache_length: int = 0          # Decoding: the cache's slots, prompt + new tokens; 0: max_len.

  @property
  def kv_heads(self) -> int:
    return self.num_kv_heads or self.num_heads

  @property
  def head_size(self) -> int:
    return self.head_dim or self.d_model // self.num_heads

  def is_local(self, layer: int) -> bool:
    """Whether layer `layer` (from 0) attends within the sliding window."""
    return bool(self.sliding_window) and not (
        self.global_every and (layer + 1) % self.global_every == 0)


def quantized(module: Transformer, paths: Sequence[str]) -> tuple[list, list]:
  """(the parameter paths among `paths` whose matmuls run at module.quantization, those its
  rules match that stay in the computation dtype: routed experts whose grouped matmul takes
  no quantized operands). Under the mesh's scope: the experts' kernel is its platform's."""
  q = Spec.of(module).quantization
  matched = [p for p in paths if q.applies(p)]
  moe = getattr(module, 'moe', moe_lib.Moe())
  if not moe.num_experts or moe.capacity_factor or moe_lib.grouped_matmul_for(
      moe.grouped_matmul, module.d_model, moe.mlp_dim, module.dtype) == 'ragged_dot':
    return matched, []
  kept = [p for p in matched if '/moe/' in f'/{p}']
  return [p for p in matched if p not in kept], kept


def check_config(m: ml_collections.ConfigDict) -> None:
  """The Transformer families' sizes and switches (config.model)."""
  if not m.get('head_dim') and m.d_model % m.num_heads:
    fail('model.num_heads', f'{m.num_heads} does not divide model.d_model={m.d_model}')
  if m.get('num_kv_heads') and m.num_heads % m.num_kv_heads:
    fail('model.num_kv_heads', f'{m.num_kv_heads} does not divide model.num_heads='
         f'{m.num_heads}; grouped-query attention needs whole groups')
  choices = {'remat': tuple(REMAT_POLICIES), 'dtype': DTYPES, 'positions': POSITIONS,
             'norm': NORMS, 'mlp_activation': MLP_ACTIVATIONS, 'attention': IMPLEMENTATIONS,
             'embedding_grad': embedding.METHODS, 'quantization': quantize.KINDS}
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
  for key in ('norm_epsilon', 'rope_theta', 'rope_factor', 'rope_beta_fast', 'rope_beta_slow'):
    if key in m and not 0 < m[key] < float('inf'):
      fail(f'model.{key}', f'must be positive, got {m[key]}')
  for key in ('attn_softcap', 'final_softcap', 'rope_local_theta', 'rope_attention_factor'):
    if key in m and not 0 <= m[key] < float('inf'):
      fail(f'model.{key}', f'must be 0 (none) or a positive number, got {m[key]}')
  if m.get('rope_scaling', 'none') not in rope_lib.SCALINGS:
    fail('model.rope_scaling', f'unknown scaling {m.rope_scaling!r}; known: '
         f'{", ".join(rope_lib.SCALINGS)}')
  if m.get('rope_scaling') == 'yarn' and not (
      m.get('rope_original_max_len', 0) > 0 and m.get('rope_factor', 1.0) >= 1
      and m.get('rope_beta_slow', 1.0) < m.get('rope_beta_fast', 32.0)):
    fail('model.rope_scaling', "'yarn' needs rope_original_max_len > 0, rope_factor >= 1 and "
         'rope_beta_slow < rope_beta_fast')
  if m.get('rope_scaling') == 'llama3' and not (
      m.get('rope_original_max_len', 0) > 0
      and 0 < m.get('rope_low_freq_factor', 1.0) < m.get('rope_high_freq_factor', 4.0)):
    fail('model.rope_scaling', "'llama3' needs rope_original_max_len > 0 and "
         '0 < rope_low_freq_factor < rope_high_freq_factor')
  if m.get('attention') == 'splash' and (m.get('sliding_window') or m.get('attn_softcap')):
    fail('model.attention', "the splash kernel here has no sliding window or soft-capped "
         "scores; use 'auto' (which runs XLA's attention in such layers) or 'xla'")
  if 'lora' in m:
    check_lora(m.lora, m.get('mlp_activation', 'gelu'))
  if 'quantize_modules' in m:
    quantize.check_modules(m.quantize_modules)


def check_lora(spec, mlp_activation: str) -> None:
  """config.model.lora: a rank, alpha, dropout and projections the model has."""
  known = {'rank', 'alpha', 'dropout', 'targets'}
  if not hasattr(spec, 'items') or set(spec.keys()) - known:
    fail('model.lora', f'must hold {", ".join(sorted(known))}, got {spec!r}')
  rank, alpha, dropout = spec.get('rank', 0), spec.get('alpha', 0.0), spec.get('dropout', 0.0)
  if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank <= 65536:
    fail('model.lora.rank', f'must be an integer in [0, 65536] (0: no adapters), got {rank!r}')
  if not 0 <= alpha < float('inf'):
    fail('model.lora.alpha', f'must be >= 0 (0: the rank, a scale of 1), got {alpha}')
  if not 0 <= dropout < 1:
    fail('model.lora.dropout', f'must be in [0, 1), got {dropout}')
  targets = spec.get('targets', ())
  gated = mlp_activation in ('swiglu', 'geglu')
  has = [p for p in lora_lib.PROJECTIONS if p != ('wi' if gated else 'wi_gate')
         and p != ('wi' if gated else 'wi_up')]
  if rank and (isinstance(targets, str) or not targets or  # Rank 0: no adapter uses them.
               not all(isinstance(t, str) for t in targets) or set(targets) - set(has)):
    fail('model.lora.targets', f'must be a tuple of this model\'s projections among '
         f'{", ".join(has)}, got {targets!r}')


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
  qkv_bias: bool
  qk_norm: bool
  post_norms: bool
  query_scale_dim: int
  attn_softcap: float
  sliding_window: int
  rope: rope_lib.Rope
  local_rope: Optional[rope_lib.Rope]
  lora: lora_lib.Lora
  attention: str
  dtype: str
  dropout_rate: float
  decode: bool
  moe: moe_lib.Moe = moe_lib.Moe()
  quantization: quantize.Quantization = quantize.Quantization()

  @classmethod
  def of(cls, module: Transformer) -> 'Spec':
    direct = {f.name for f in dataclasses.fields(cls)} - {'rope', 'local_rope', 'moe',
                                                          'quantization'}
    global_rope = rope_lib.Rope(
        module.rope_theta, module.rope_scaling, module.rope_factor, module.rope_low_freq_factor,
        module.rope_high_freq_factor, module.rope_original_max_len, module.rope_beta_fast,
        module.rope_beta_slow, module.rope_attention_factor)
    local_rope = rope_lib.Rope(module.rope_local_theta) if module.rope_local_theta else None
    moe = getattr(module, 'moe', moe_lib.Moe())  # The families that have routed experts.
    quantization = quantize.Quantization(module.quantization, tuple(module.quantize_modules))
    return cls(rope=global_rope, local_rope=local_rope, moe=moe, quantization=quantization,
               **{name: getattr(module, name) for name in direct})


def norm(module: 'Transformer | Spec', name: str) -> nn.Module:
  """The module's normalisation layer over d_model (zoo.models.layers.norm)."""
  return norm_layer(module.norm, module.norm_epsilon, module.dtype, name)


class MlpBlock(nn.Module):
  """Two-layer MLP (GELU) or gated one (SwiGLU: SiLU, GeGLU: tanh GELU); the hidden units
  are split over 'model'."""
  mlp_dim: int
  activation: str = 'gelu'
  use_bias: bool = False
  dtype: str = 'float32'
  lora: lora_lib.Lora = lora_lib.Lora()
  deterministic: bool = True
  quantization: quantize.Quantization = quantize.Quantization()

  @nn.compact
  def __call__(self, x_BLD: jax.Array) -> jax.Array:
    d_model = x_BLD.shape[-1]

    def dense(name, y, w_shape, axes):
      w = param(self, name, w_shape, axes, self.dtype)
      return lora_lib.einsum(self, self.lora, name, 'D', 'F', y, w, axes, self.dtype,
                             self.deterministic)
    if self.activation in ('swiglu', 'geglu'):
      gate_BLF = dense('wi_gate', x_BLD, (d_model, self.mlp_dim), ('embed', 'mlp'))
      gate_BLF = (nn.silu(gate_BLF) if self.activation == 'swiglu'
                  else nn.gelu(gate_BLF, approximate=True))
      h_BLF = gate_BLF * dense('wi_up', x_BLD, (d_model, self.mlp_dim), ('embed', 'mlp'))
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
  """Pre-norm residual block: self-attention, optional cross-attention, MLP; with
  `post_norms` each branch's output is normalised too before it is added (Gemma 2).

  Returns (x, the routed experts' router statistics, or None) so that the same block runs
  unrolled or as the body of `nn.scan` (which stacks them over layers). `local`: the layer
  attends within the sliding window; None: the call's `local` argument says (a traced flag,
  when layers differ under nn.scan). `routed`: the MLP is the spec's routed experts
  (zoo.models.moe), plus its shared expert if it has one.
  """
  spec: Spec                 # The family's sizes and switches.
  causal: bool = False
  cross: bool = False
  rotary: bool = False
  cache_length: int = 0
  deterministic: bool = True
  local: Optional[bool] = False
  routed: bool = False

  @nn.compact
  def __call__(self, x_BLD: jax.Array, context_BMD: Optional[jax.Array] = None,
               positions_BL: Optional[jax.Array] = None,
               start_B: Optional[jax.Array] = None,
               segments_BL: Optional[jax.Array] = None,
               local: Optional[jax.Array] = None) -> tuple[jax.Array, Optional[dict]]:
    s = self.spec
    drop = lambda y: nn.Dropout(s.dropout_rate)(y, deterministic=self.deterministic)
    attention = dict(num_heads=s.num_heads, head_dim=s.head_size, use_bias=s.use_bias,
                     implementation=s.attention, dtype=s.dtype, lora=s.lora,
                     deterministic=self.deterministic, quantization=s.quantization)

    def branch(y_BLD, name):  # A branch's output, normalised with post_norms.
      return drop(norm(s, f'{name}_out')(y_BLD) if s.post_norms else y_BLD)
    x_BLD = x_BLD + branch(Attention(
        num_kv_heads=s.kv_heads, causal=self.causal, rotary=self.rotary, rope=s.rope,
        local_rope=s.local_rope, qkv_bias=s.qkv_bias, qk_norm=s.norm if s.qk_norm else '',
        norm_epsilon=s.norm_epsilon, query_scale_dim=s.query_scale_dim, softcap=s.attn_softcap,
        window=s.sliding_window, decode=s.decode, cache_length=self.cache_length, **attention,
        name='attn')(norm(s, 'ln_attn')(x_BLD), None, positions_BL, start_B, segments_BL,
                     self.local if self.local is not None else local), 'ln_attn')
    if self.cross:
      x_BLD = x_BLD + drop(Attention(num_kv_heads=s.num_heads, **attention, name='cross_attn')(
          norm(s, 'ln_cross')(x_BLD), context_BMD))
    y_BLD, stats = norm(s, 'ln_mlp')(x_BLD), None
    if self.routed:
      mask_BL = None if segments_BL is None else segments_BL > 0  # Packing's padding: 0.
      out_BLD, stats = moe_lib.MoeBlock(s.moe, s.mlp_activation, s.dtype, s.quantization,
                                        name='moe')(y_BLD, mask_BL)
      if s.moe.shared_mlp_dim:  # Qwen2-MoE: a dense expert every token takes, gated.
        gate_D = param(self, 'shared_gate', (y_BLD.shape[-1],), ('embed',), jnp.float32)
        gate_BL = jax.nn.sigmoid(jnp.einsum('BLD,D->BL', y_BLD.astype(jnp.float32), gate_D))
        shared_BLD = MlpBlock(s.moe.shared_mlp_dim, s.mlp_activation, s.use_bias, s.dtype,
                              s.lora, self.deterministic, s.quantization,
                              name='shared_expert')(y_BLD)
        out_BLD = out_BLD + (gate_BL[..., None] * shared_BLD).astype(out_BLD.dtype)
    else:
      out_BLD = MlpBlock(s.mlp_dim, s.mlp_activation, s.use_bias, s.dtype, s.lora,
                         self.deterministic, s.quantization, name='mlp')(y_BLD)
    x_BLD = x_BLD + branch(out_BLD, 'ln_mlp')
    return nn.with_logical_constraint(x_BLD, ('act_batch', 'act_len', 'act_embed')), stats


def blocks(module: Transformer, x_BLD: jax.Array, context_BMD: Optional[jax.Array] = None, *,
           prefix: str, train: bool, causal: bool = False, cross: bool = False,
           rotary: bool = False, positions_BL: Optional[jax.Array] = None,
           start_B: Optional[jax.Array] = None, segments_BL: Optional[jax.Array] = None,
           cache_length: int = 0, stats: Optional[list] = None) -> jax.Array:
  """Runs `module.num_layers` Blocks, unrolled (`{prefix}_{i}`) or under nn.scan (`{prefix}s`).

  Call inside the `nn.compact` method of a Transformer `module`: the blocks become its
  submodules, sized and switched by its fields. Layers with routed experts (`routed_layers`
  of a module with `moe`) append their router statistics to `stats`, one dict per layer
  (under nn.scan, sliced from the scan's stacked ones).
  """
  cls = Block
  policy = REMAT_POLICIES[module.remat]
  if policy is not None:
    # Under scan, the loop already keeps XLA from merging the recomputation away.
    cls = nn.remat(Block, policy=policy, prevent_cse=not module.scan_layers)
  fields = dict(spec=Spec.of(module), causal=causal, cross=cross, rotary=rotary,
                cache_length=cache_length, deterministic=not train)
  extra = (context_BMD, positions_BL, start_B, segments_BL)  # The same for every block.
  local = [module.is_local(i) for i in range(module.num_layers)]
  routed = getattr(module, 'routed_layers', lambda: ())()
  stats = [] if stats is None else stats
  if module.scan_layers:
    mixed = len(set(local)) > 1  # Then each layer's flag is scanned over, with its params.
    stack = nn.scan(cls, variable_axes={'params': 0, 'cache': 0},
                    split_rngs={'params': True, 'dropout': True},
                    in_axes=(nn.broadcast,) * len(extra) + ((0,) if mixed else ()),
                    length=module.num_layers, metadata_params={nn.PARTITION_NAME: 'layers'})
    flags = (jnp.array(local),) if mixed else ()
    x_BLD, scanned = stack(**fields, local=None if mixed else local[0],
                           routed=bool(routed), name=f'{prefix}s')(x_BLD, *extra, *flags)
    if scanned is not None:  # Every layer routed (transformer_lm checks).
      stats.extend(jax.tree.map(lambda v, i=i: v[i], scanned)
                   for i in range(module.num_layers))
    return x_BLD
  for i in range(module.num_layers):
    x_BLD, layer = cls(**fields, local=local[i], routed=i in routed, name=f'{prefix}_{i}')(
        x_BLD, *extra)
    if layer is not None:
      stats.append(layer)
  return x_BLD


def embed_tokens(module: Transformer, embed_VD: jax.Array, tokens_BL: jax.Array) -> jax.Array:
  """The rows of `embed_VD` for `tokens_BL`, differentiated by module.embedding_grad."""
  method = embedding.method_for(module.embedding_grad, embed_VD.shape[0])
  return embedding.lookup(embed_VD, tokens_BL, method)


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
