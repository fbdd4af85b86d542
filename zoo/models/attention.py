"""Attention for the Transformer families: multi-head or grouped-query, self- or cross-,
with a key/value cache for decoding, packed documents' segments, sliding windows, soft-capped
scores and per-head query/key norms.

- Grouped-query attention (Ainslie et al., arXiv:2305.13245): num_kv_heads < num_heads;
  query head n reads key/value head n // (num_heads / num_kv_heads), keys and values never
  repeated.
- A local layer (`window` > 0) attends to the last `window` positions, itself included
  (query i sees key j iff i - j < window: Mistral's and Gemma's sliding window, in the key/
  value cache too). `local` says whether this layer is one: a Python bool, or under
  nn.scan a traced one (layers alternate local and global in Gemma 2 and 3).
- Soft-capped scores (Gemma 2): cap * tanh(scores / cap) before the mask, computed here in
  XLA (no fused kernel has the cap).
- The implementation (`implementation`): 'xla' or 'cudnn' (cuDNN's fused flash attention),
  jax.nn.dot_product_attention's, or 'splash' (the Pallas TPU kernel, zoo.models.splash);
  'auto' (the default) picks by the platform the step is compiled for: cuDNN on NVIDIA GPUs,
  splash on TPUs, XLA's elsewhere. A layer the chosen kernel cannot take (a float32 model on
  cuDNN, soft-capped scores, a sliding window on splash, decoding from a cache, shapes a
  kernel refuses) runs XLA's and says so once in the log; `recording()` collects each
  layer's choice for the plan (zoo.run.plan).
- Query/key norms (Qwen3, Gemma 3): each head's queries and keys normalised over the head
  size before the rotation.
- A sequence split over the mesh (context parallelism, zoo.parallel.sharding.context_rules):
  the queries stay split, the keys and values are gathered whole ('act_kv_len'), and the
  masks (causal, window, segments) come from the tokens' positions, so a row fed in any
  order (zoo.parallel.context's load-balanced one) attends exactly as in order. Splash takes
  a split sequence of causal self-attention where the rows are known to be in the
  load-balanced order (`balanced_rows`, which a language model's train and eval steps
  enter); XLA's attention runs everywhere else (cuDNN's partitioner takes no split).

Shapes are suffixed: B batch, L (M) query (key) length, D d_model, N heads, G key/value
heads, K heads per group, H head size, S cache positions, R LoRA rank.
"""
import contextlib
import contextvars
from typing import Any, Iterator, Optional, Union

from absl import logging
import flax.linen as nn
import jax
import jax.numpy as jnp

from zoo.models import lora as lora_lib
from zoo.models import quantize
from zoo.models import rope as rope_lib
from zoo.models import splash
from zoo.models.layers import norm, param, platform
from zoo.parallel import sharding

Flag = Union[bool, jax.Array]  # A layer's `local`: static, or traced under nn.scan.


IMPLEMENTATIONS = ('auto', 'xla', 'cudnn', 'splash')
_SAID: set = set()  # (layer path, reason) pairs logged.
_record: Optional[dict] = None  # While recording(): layer path -> (implementation, why).
# Inside balanced_rows(): rows under a split sequence are in the load-balanced order.
_balanced = contextvars.ContextVar('zoo_balanced_rows', default=False)


def auto(platform_name: str) -> str:
  """What 'auto' picks on a platform: the fused kernel its vendor ships."""
  return {'gpu': 'cudnn', 'cuda': 'cudnn', 'tpu': 'splash'}.get(platform_name, 'xla')


@contextlib.contextmanager
def recording() -> Iterator[dict]:
  """Collects, while steps are traced inside it, each attention layer's implementation:
  {layer path: (implementation run, why not the requested one or '')}."""
  global _record  # pylint: disable=global-statement
  outer, _record = _record, {}
  try:
    yield _record
  finally:
    _record = outer


@contextlib.contextmanager
def balanced_rows(balanced: bool = True) -> Iterator[None]:
  """Says, to the attention traced inside it, whether the rows it gets come in context
  parallelism's load-balanced order (zoo.parallel.context, for the shards the mesh splits
  the sequence into): then the splash kernel, whose causal mask is built for that order,
  may take a split sequence. Entered inside the traced step (zoo.run.steps) by the code
  that knows how its batches were fed; elsewhere XLA's attention runs, exact in any order."""
  token = _balanced.set(balanced)
  try:
    yield
  finally:
    _balanced.reset(token)


def is_recording() -> bool:
  """Whether a `recording()` is open: programs traced now must be traced afresh."""
  return _record is not None


def _ran(path: str, requested: str, kernel: str, why: str = '') -> None:
  """Records what a layer ran: `kernel`, or XLA's attention where `why` says it could not
  (logged once per layer and reason)."""
  if _record is not None:
    _record[path] = ('xla' if why else kernel, why)
  if why and (path, why) not in _SAID:
    _SAID.add((path, why))
    chose = f' ({kernel} on {platform()})' if requested == 'auto' else ''
    where = f'{path}: ' if path else ''
    logging.warning("model.attention=%r%s: %s%s; XLA's attention runs there instead",
                    requested, chose, where, why)


def _cudnn_refusal(kv_axis: str) -> str:
  """Why cuDNN's kernel cannot take this layer's sharding ('' if it can): its partitioner
  refuses, when the step compiles, a sequence or head size split over the mesh and queries
  split unlike keys and values."""
  q_spec, kv_spec = splash.specs(kv_axis)
  if splash.splits_sequence(q_spec):
    return splash.SPLIT_SEQUENCE
  if tuple(q_spec) != tuple(kv_spec):
    return 'the rules split queries and keys/values differently'
  return ''


def sequence_split() -> bool:
  """Whether the current mesh and rules split the sequence ('act_len') over several
  devices: context parallelism, where a row's positions may come in any order (the feed's
  load-balanced layout, zoo.parallel.context) and masks follow the positions."""
  mesh = jax.sharding.get_abstract_mesh()
  return not mesh.empty and sharding.sequence_shards(mesh, nn.get_logical_axis_rules()) > 1


def _by_position(positions_BL: jax.Array, causal: bool, window: int, local: Flag,
                 segments_BL: Optional[jax.Array]) -> Optional[jax.Array]:
  """[B, 1, L, L]: which keys each query of self-attention sees, from the tokens' own
  positions and segments rather than their order along the sequence (exact in any order):
  causal, key position <= query position; local, query - key < window; packed, the same
  segment. None: every key."""
  mask = None

  def both(a, b):
    return b if a is None else a & b
  q_BL1, k_B1L = positions_BL[:, :, None], positions_BL[:, None, :]
  if causal:
    mask = both(mask, k_B1L <= q_BL1)
  if window and local is not False:
    near = q_BL1 - k_B1L < window
    mask = both(mask, near if local is True else near | ~local)
  if segments_BL is not None:
    mask = both(mask, segments_BL[:, :, None] == segments_BL[:, None, :])
  return None if mask is None else mask[:, None]


def _select(local: Flag, if_local: Any, otherwise: Any) -> Any:
  if isinstance(local, bool):
    return if_local if local else otherwise
  return jnp.where(local, jnp.asarray(if_local), jnp.asarray(otherwise))


def _window(query_L: jax.Array, key_M: jax.Array, window: int, local: Flag) -> Optional[jax.Array]:
  """[L, M]: which keys a local layer's queries see (i - j < window), all for a global one;
  None if no layer is local."""
  if not window or local is False:
    return None
  near_LM = query_L[:, None] - key_M[None, :] < window
  return near_LM if local is True else near_LM | ~local


def _grouped(q_BLNH, k, v, mask, causal, scale, cap=0.0, kv='BMGH'):
  """XLA's attention with each key/value head read by its group of query heads in place
  (never repeated), scores soft-capped to cap * tanh(scores / cap) when cap > 0, softmax in
  float32. `kv` is the keys' and values' layout: 'BMGH' as projected, or 'BGMH' (the
  decoding cache: the two products then read it without a transpose)."""
  batch, length, heads, head = q_BLNH.shape
  groups, keys = k.shape[kv.index('G')], k.shape[kv.index('M')]
  q_BLGKH = q_BLNH.reshape(batch, length, groups, heads // groups, head)
  s_BGKLM = jnp.einsum(f'BLGKH,{kv}->BGKLM', q_BLGKH, k,
                       preferred_element_type=jnp.float32) * scale
  if cap:
    s_BGKLM = cap * jnp.tanh(s_BGKLM / cap)
  allowed = jnp.ones((length, keys), bool)
  if causal:
    allowed = jnp.tril(allowed)
  allowed = allowed[None, None, None] if mask is None else (allowed & mask)[:, :, None]
  s_BGKLM = jnp.where(allowed, s_BGKLM, jnp.finfo(jnp.float32).min)
  p_BGKLM = jax.nn.softmax(s_BGKLM, axis=-1).astype(v.dtype)
  # Heads before length in the product, then moved (on CPU 18x faster than the product
  # writing BLGKH itself, for one decoding step).
  out_BGKLH = jnp.einsum(f'BGKLM,{kv}->BGKLH', p_BGKLM, v)
  return out_BGKLH.transpose(0, 3, 1, 2, 4).reshape(batch, length, heads, head)


class Attention(nn.Module):
  """Multi-head or grouped-query attention: self-attention, or cross-attention to
  `context_BMD`."""
  num_heads: int
  num_kv_heads: int
  head_dim: int
  causal: bool = False
  rotary: bool = False
  rope: rope_lib.Rope = rope_lib.Rope()         # Global layers' rotation.
  local_rope: Optional[rope_lib.Rope] = None    # Local layers' (Gemma 3); None: `rope`.
  use_bias: bool = False
  qkv_bias: bool = False                # Biases on queries, keys and values only (Qwen2).
  qk_norm: str = ''                     # A norm kind (zoo.models.transformer.norm) or ''.
  norm_epsilon: float = 1e-6
  query_scale_dim: int = 0              # Scores scaled by this**-0.5; 0: head_dim.
  softcap: float = 0.0
  window: int = 0
  implementation: str = 'auto'  # One of IMPLEMENTATIONS.
  dtype: str = 'float32'
  decode: bool = False
  cache_length: int = 0
  lora: lora_lib.Lora = lora_lib.Lora()
  deterministic: bool = True
  quantization: quantize.Quantization = quantize.Quantization()

  def _project(self, name, y_BLD, heads, axes, act):
    w_DNH = param(self, name, (y_BLD.shape[-1], heads, self.head_dim), axes, self.dtype)
    y_BLNH = lora_lib.einsum(self, self.lora, name, 'D', 'NH', y_BLD, w_DNH, axes, self.dtype,
                             self.deterministic)
    if self.use_bias or self.qkv_bias:
      y_BLNH = y_BLNH + param(self, f'{name}_bias', (heads, self.head_dim), axes[1:], self.dtype,
                              nn.initializers.zeros_init())
    if self.qk_norm and name in ('query', 'key'):
      y_BLNH = norm(self.qk_norm, self.norm_epsilon, self.dtype, f'{name}_norm', ('kv',))(y_BLNH)
    return nn.with_logical_constraint(y_BLNH, act)

  @nn.compact
  def __call__(self, x_BLD: jax.Array, context_BMD: Optional[jax.Array] = None,
               positions_BL: Optional[jax.Array] = None,
               start_B: Optional[jax.Array] = None,
               segments_BL: Optional[jax.Array] = None, local: Flag = False) -> jax.Array:
    """`segments_BL` (self-attention): a query sees only keys of its own segment (packed
    documents, zoo.data.packing). `local`: this layer attends within `window`."""
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
    # As jax arrays: a host batch's (model.init's example) would build the L x L masks in
    # NumPy, eagerly (16 GiB at 131,072 positions), where jnp stages them.
    positions_BL = jnp.asarray(positions_BL)
    segments_BL = None if segments_BL is None else jnp.asarray(segments_BL)
    if self.rotary:
      frequencies, turned = self.rope.frequencies(self.head_dim), self.rope.scale()
      if self.local_rope is not None:
        frequencies = _select(local, self.local_rope.frequencies(self.head_dim), frequencies)
        turned = turned if turned == 1.0 else _select(local, self.local_rope.scale(), turned)
      q_BLNH = rope_lib.rotate(q_BLNH, positions_BL, frequencies, turned)
      k_BMGH = rope_lib.rotate(k_BMGH, positions_BL, frequencies, turned)
    mask, causal, gathered = None, self.causal, None
    scale = (self.query_scale_dim or self.head_dim) ** -0.5
    if self.decode:  # XLA's, over the whole cache: its mask is causal.
      k_BGSH, v_BGSH, mask = self._extend_cache(k_BMGH, v_BMGH, start_B, kv_act, local)
      out_BLNH = _grouped(q_BLNH, k_BGSH, v_BGSH, mask, False, scale, self.softcap, 'BGMH')
    elif sequence_split():  # Context parallelism: XLA's attention gathers keys and values.
      kv_whole = ('act_batch', 'act_kv_len', kv_act[2], 'act_kv')
      gathered = tuple(nn.with_logical_constraint(t, kv_whole) for t in (k_BMGH, v_BMGH))
      if context_BMD is None:
        mask = _by_position(positions_BL, causal, self.window, local, segments_BL)
        causal = False
      out_BLNH = (_grouped(q_BLNH, *gathered, mask, causal, scale, self.softcap)
                  if self.softcap else None)
    else:
      if segments_BL is not None:
        mask = (segments_BL[:, :, None] == segments_BL[:, None, :])[:, None]  # [B, 1, L, M]
      near_LM = _window(jnp.arange(x_BLD.shape[1]), jnp.arange(kv_BMD.shape[1]), self.window,
                        local)
      if near_LM is not None:
        mask = near_LM[None, None] if mask is None else mask & near_LM
      out_BLNH = (_grouped(q_BLNH, k_BMGH, v_BMGH, mask, causal, scale, self.softcap)
                  if self.softcap else None)
    if not self.is_initializing():  # Init traces shapes only: XLA's below.
      out_BLNH = self._fused(out_BLNH, q_BLNH, k_BMGH, v_BMGH, mask, causal, scale, kv_act[2],
                             segments_BL, local, context_BMD is None)
    if out_BLNH is None:
      if gathered:  # A split sequence: the kernels take the keys split and gather them.
        k_BMGH, v_BMGH = gathered
      out_BLNH = jax.nn.dot_product_attention(
          q_BLNH, k_BMGH, v_BMGH, mask=mask, is_causal=causal,
          scale=scale if self.query_scale_dim else None, implementation='xla')
    out_BLNH = nn.with_logical_constraint(out_BLNH, act)
    w_NHD = param(self, 'out', (self.num_heads, self.head_dim, d_model), ('heads', 'kv', 'embed'),
                  self.dtype)
    out_BLD = lora_lib.einsum(self, self.lora, 'out', 'NH', 'D', out_BLNH, w_NHD,
                              ('heads', 'kv', 'embed'), self.dtype, self.deterministic)
    if self.use_bias:
      out_BLD = out_BLD + param(self, 'out_bias', (d_model,), ('embed',), self.dtype,
                                nn.initializers.zeros_init())
    return out_BLD

  def _fused(self, computed, q_BLNH, k_BMGH, v_BMGH, mask, causal, scale, kv_axis,
             segments_BL, local, self_attention):
    """The chosen kernel's output, or `computed` (XLA's, computed already for a cache or
    capped scores; None: computed after) where XLA's attention runs (recorded and, for a
    kernel that could not take the layer, logged). `self_attention`: the keys are the
    queries' own sequence. Explicit 'cudnn' raises what cuDNN refuses; 'auto' falls back."""
    requested = self.implementation
    kernel = auto(platform()) if requested == 'auto' else requested
    path = '/'.join(self.scope.path)
    why = ''
    if kernel == 'xla':
      pass
    elif self.decode:
      why = 'decoding from a key/value cache'
    elif computed is not None:
      why = 'soft-capped scores'
    elif kernel == 'splash':
      if sequence_split():  # `causal` is False there: the masks were made from positions.
        causal = self.causal and self_attention
      why = ('a sliding window' if self.window and local is not False else
             splash.refusal(q_BLNH, k_BMGH, kv_axis, causal, _balanced.get()))
      if not why:
        _ran(path, requested, kernel)
        return splash.attention(q_BLNH, k_BMGH, v_BMGH, causal, kv_axis, segments_BL, scale)
    elif kernel == 'cudnn':
      if requested == 'auto' and q_BLNH.dtype not in (jnp.bfloat16, jnp.float16):
        why = f'{q_BLNH.dtype} computation (cuDNN takes bfloat16 or float16)'
      elif requested == 'auto':
        why = _cudnn_refusal(kv_axis)
      if not why:
        try:
          out_BLNH = jax.nn.dot_product_attention(
              q_BLNH, k_BMGH, v_BMGH, mask=mask, is_causal=causal,
              scale=scale if self.query_scale_dim else None, implementation='cudnn')
          _ran(path, requested, kernel)
          return out_BLNH
        except (NotImplementedError, ValueError, RuntimeError) as e:  # cuDNN's refusals.
          if requested != 'auto':
            raise
          why = f'cuDNN refused it ({str(e).splitlines()[0][:160]})'
    _ran(path, requested, kernel, why)
    return computed

  def _extend_cache(self, k_BLGH, v_BLGH, start_B, kv_act, local):
    """Writes this call's keys and values at the cache's next positions; returns the whole
    cache, [B, G, S, H] (heads before slots, the layout both attention products read
    without a transpose), and the mask [B, 1, L, S]: a query sees its row's positions from
    start_B (left padding before it) up to its own, a local layer's only the last
    `window` of them."""
    batch, length = k_BLGH.shape[:2]
    shape = (batch, self.num_kv_heads, self.cache_length, self.head_dim)
    cached_k = self.variable('cache', 'key', jnp.zeros, shape, k_BLGH.dtype)
    cached_v = self.variable('cache', 'value', jnp.zeros, shape, v_BLGH.dtype)
    index = self.variable('cache', 'index', lambda: jnp.zeros((), jnp.int32))
    i = index.value
    cache_act = (kv_act[0], kv_act[2], kv_act[1], kv_act[3])
    for cached, new_BLGH in ((cached_k, k_BLGH), (cached_v, v_BLGH)):
      cached.value = nn.with_logical_constraint(jax.lax.dynamic_update_slice(
          cached.value, new_BLGH.transpose(0, 2, 1, 3), (0, 0, i, 0)), cache_act)
    index.value = i + length
    if start_B is None:
      start_B = jnp.zeros((batch,), jnp.int32)
    slots_S = jnp.arange(self.cache_length)
    query_L = i + jnp.arange(length)
    mask_BLS = (slots_S[None, None, :] <= query_L[None, :, None]) & (
        slots_S[None, None, :] >= start_B[:, None, None])
    near_LS = _window(query_L, slots_S, self.window, local)  # Slots are positions + padding.
    if near_LS is not None:
      mask_BLS = mask_BLS & near_LS[None]
    return cached_k.value, cached_v.value, mask_BLS[:, None]

