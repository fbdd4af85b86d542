"""Routed experts: a mixture-of-experts MLP (Shazeer et al., arXiv:1701.06538; GShard,
arXiv:2006.16668; Mixtral, arXiv:2401.04088), dropless by default (MegaBlocks,
arXiv:2211.15841).

Each token's router logits pick its `experts_per_token` (k) experts: a softmax over all
experts, the top k, renormalised to sum to 1 if `norm_topk_prob` (Mixtral's routing, and
Qwen2/3-MoE's where their config says so). The token's output is the gate-weighted sum of
its experts' SwiGLU (or GELU) MLPs; with `shared_mlp_dim` the Transformer block adds a
dense shared expert scaled by sigmoid(x . shared_gate) (Qwen2-MoE; zoo.models.transformer).

The dispatch runs under `jax.shard_map` over the whole mesh, on each device's own tokens:
its k choices are sorted by expert and the experts' matmuls are *grouped* matmuls over the
sorted rows (`grouped_matmul`: Megablox on TPU, the Mosaic GPU ragged dot on NVIDIA GPUs,
`jax.lax.ragged_dot` elsewhere). Expert weights [E, D, F] carry logical axes ('experts',
'expert_embed', 'mlp'): their hidden units split over the 'model' mesh axis like a dense
MLP's (each device's partial outputs are summed after the shard_map); FSDP's split of
'expert_embed' is gathered at the shard_map's edge. Where the rules map 'experts' onto a
mesh axis (an 'expert' axis of mesh.axes; zoo.parallel.sharding.expert_rules) each device
holds E / P experts and the rows travel to their expert's device and back by all-to-all
(expert parallelism):
- `jax.lax.ragged_all_to_all` on TPU and GPU, into a receive buffer of `buffer` x the
  rows a device sends (0: the worst case, every row of every device: dropless);
- on CPU, where XLA has no ragged all-to-all, fixed slabs of rows per pair of devices
  (`buffer` x rows / P each; 0: all of them) through `jax.lax.all_to_all`.
With `capacity_factor` > 0 every expert takes at most capacity_factor x its even share of
a device's rows (GShard's capacity): static [E, C, D] buffers and plain batched matmuls.
Rows that a bounded buffer or a capacity turns away are dropped (their token keeps its
residual) and counted: the 'dropped' metric of each layer, never silent.

Router losses (zoo.models.transformer_lm pools them over layers): the load-balance loss in
Hugging Face's convention (E x sum over experts of the fraction of tokens choosing it times
its mean router probability, pooled over every MoE layer: k for a balanced router), and the
router z-loss (ST-MoE, arXiv:2202.08906: the mean squared logsumexp of the logits).

Shapes: B batch, L length, D d_model, E experts, K experts per token, F expert hidden
units, T a device's tokens, N its routed rows (T x K), P expert-parallel devices.
"""
import dataclasses
import math
import re
from typing import Any, Optional

from absl import logging
import flax.linen as nn
import jax
import jax.numpy as jnp

from zoo.models import quantize
from zoo.models.layers import param, platform
from zoo.parallel.sharding import mesh_axes_of

GROUPED_MATMULS = ('auto', 'ragged_dot', 'megablox', 'mosaic_gpu')
# Platforms whose XLA has ragged_all_to_all (XLA:CPU does not: jax #34755).
RAGGED_ALL_TO_ALL = ('tpu', 'gpu')


@dataclasses.dataclass(frozen=True)
class Moe:
  """A Transformer's routed-experts settings as a plain value (0 experts: dense MLPs)."""
  num_experts: int = 0
  experts_per_token: int = 2
  mlp_dim: int = 0                 # Each expert's hidden units.
  norm_topk_prob: bool = True
  shared_mlp_dim: int = 0          # 0: no shared expert.
  capacity_factor: float = 0.0     # 0: dropless.
  buffer: float = 0.0              # Expert parallelism's receive buffer; 0: the worst case.
  grouped_matmul: str = 'auto'


_SAID: set = set()  # The reasons logged for not running the GPU kernel.


def grouped_matmul_for(method: str, d: int, f: int, dtype: Any) -> str:
  """'auto' resolved for the platform being traced for and a [D] x [D, F] product: Megablox
  on TPU; on NVIDIA GPUs the Mosaic GPU kernel where it runs (Hopper, bf16 or fp16, sizes
  in multiples of 128), else ragged_dot, said once per reason; ragged_dot elsewhere."""
  if method != 'auto':
    return method
  where = platform()
  if where != 'gpu':
    return 'megablox' if where == 'tpu' else 'ragged_dot'
  device = getattr(jax.sharding.get_abstract_mesh(), 'abstract_device', None) or jax.devices()[0]
  why = ('not a Hopper GPU' if not re.search(r'H(100|200|800|20)\b', device.device_kind) else
         f'{jnp.dtype(dtype).name} (it takes bfloat16 or float16)'
         if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16) else
         f'a {d} x {f} product (it takes multiples of 128)' if d % 128 or f % 128 else '')
  if not why:
    return 'mosaic_gpu'
  if why not in _SAID:
    _SAID.add(why)
    logging.warning("model.grouped_matmul='auto' on %s: Mosaic GPU's grouped matmul cannot "
                    'take %s; jax.lax.ragged_dot runs instead (a dense masked dot over every '
                    'expert on GPUs: slow)', device.device_kind, why)
  return 'ragged_dot'


def grouped_matmul(rows_ND: jax.Array, w_GDF: jax.Array, sizes_G: jax.Array, method: str,
                   dtype: Any, q: quantize.Quantization = quantize.Quantization(),
                   path: str = '') -> jax.Array:
  """rows [N, D] times the weight of their group [G, D, F] -> [N, F], the rows sorted by
  group with sizes_G of each; rows after the last group come out as zeros. Quantized by `q`
  if it applies to the kernel's parameter `path` and the kernel is ragged_dot."""
  method = grouped_matmul_for(method, rows_ND.shape[1], w_GDF.shape[2], dtype)
  sizes_G = sizes_G.astype(jnp.int32)
  if method == 'ragged_dot':
    out = quantize.ragged_dot(q, path, rows_ND, w_GDF, sizes_G)
    if out is None:
      out = jax.lax.ragged_dot(rows_ND, w_GDF, sizes_G, preferred_element_type=jnp.float32)
    return out.astype(dtype)
  quantize.not_taken(q, path, method)
  n, d = rows_ND.shape
  f = w_GDF.shape[2]
  # The kernels leave rows outside every group unwritten, in the rows' gradient too.
  valid = jnp.arange(n) < sizes_G.sum()
  rows_ND = _zero_grad_outside(rows_ND, valid)
  if method == 'megablox':
    from jax.experimental.pallas.ops.tpu import megablox  # pylint: disable=g-import-not-at-top
    tile = lambda size, most: math.gcd(size, most)
    padded = -(-n // 128) * 128 if n >= 128 else -(-n // 8) * 8
    tiling = (min(padded, 512 if padded % 512 == 0 else 128), tile(d, 1024), tile(f, 1024))
    out = megablox.gmm(jnp.pad(rows_ND, ((0, padded - n), (0, 0))), w_GDF, sizes_G,
                       preferred_element_type=dtype, tiling=tiling,
                       interpret=platform() != 'tpu')[:n]
  elif method == 'mosaic_gpu':
    out = _mosaic_gpu_gmm(rows_ND.astype(dtype), w_GDF.astype(dtype), sizes_G)
  else:
    raise ValueError(f'unknown grouped matmul {method!r}; known: {", ".join(GROUPED_MATMULS)}')
  return jnp.where(valid[:, None], out, 0).astype(dtype)


@jax.custom_vjp
def _zero_grad_outside(rows_ND, valid_N):
  """The rows; in the backward pass, their gradient zeroed where not `valid_N`."""
  del valid_N
  return rows_ND


_zero_grad_outside.defvjp(lambda rows, valid: (rows, valid),
                          lambda valid, d: (jnp.where(valid[:, None], d, 0), None))


# The Mosaic GPU kernels' tiles, each kernel its own (benchmarks/moe_bench.py --tune measures
# candidates on a GPU): the forward, the rows' gradient (the same kernel on the transposed
# weights) and the weights' gradient (the transposed ragged dot).
_TILES = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1)
_MGPU = {'forward': _TILES, 'rows_grad': _TILES, 'weights_grad': _TILES}


@jax.custom_vjp
def _mosaic_gpu_gmm(rows_ND, w_GDF, sizes_G):
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu  # pylint: disable=g-import-not-at-top
  return ragged_dot_mgpu.ragged_dot(rows_ND, w_GDF, group_sizes=sizes_G, **_MGPU['forward'])


def _mosaic_gpu_fwd(rows_ND, w_GDF, sizes_G):
  return _mosaic_gpu_gmm(rows_ND, w_GDF, sizes_G), (rows_ND, w_GDF, sizes_G)


def _mosaic_gpu_bwd(residuals, d_NF):
  """The rows' gradient is the same kernel on the transposed weights; the weights' is the
  transposed ragged dot (contracting over each group's rows)."""
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu  # pylint: disable=g-import-not-at-top
  rows_ND, w_GDF, sizes_G = residuals
  d_NF = d_NF.astype(rows_ND.dtype)
  d_rows = ragged_dot_mgpu.ragged_dot(d_NF, w_GDF, group_sizes=sizes_G, transpose_rhs=True,
                                      **_MGPU['rows_grad'])
  d_w = transposed_ragged_dot_mgpu.transposed_ragged_dot(rows_ND, d_NF, group_sizes=sizes_G,
                                                         **_MGPU['weights_grad'])
  return d_rows, d_w.astype(w_GDF.dtype), None


_mosaic_gpu_gmm.defvjp(_mosaic_gpu_fwd, _mosaic_gpu_bwd)


def route(logits_TE: jax.Array, k: int, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
  """(the k chosen experts' gates [.., K] float32, their ids [.., K]) from router logits:
  softmax over all experts, top k, renormalised if `norm_topk_prob`."""
  probs = jax.nn.softmax(logits_TE.astype(jnp.float32), axis=-1)
  gates, ids = jax.lax.top_k(probs, k)
  if norm_topk_prob:
    gates = gates / gates.sum(axis=-1, keepdims=True)
  return gates, ids


def _expert_mlps(x, w, activation, matmul):
  """The experts' MLPs (gated or not) by `matmul(x, name)`, the kernel w[name]: grouped
  over rows sorted by expert, or batched over per-expert blocks."""
  if 'wi_gate' in w:
    gate = matmul(x, 'wi_gate')
    gate = nn.silu(gate) if activation == 'swiglu' else nn.gelu(gate, approximate=True)
    h = gate * matmul(x, 'wi_up')
  else:
    h = nn.gelu(matmul(x, 'wi'), approximate=activation == 'gelu')
  return matmul(h, 'wo')


def _mlp(plan, rows_ND, sizes_G, w):
  """The experts' MLPs on rows sorted by expert, `sizes_G` of each (grouped matmuls)."""
  return _expert_mlps(rows_ND, w, plan.activation, lambda x, name: grouped_matmul(
      x, w[name], sizes_G, plan.method, plan.dtype, plan.quantization, f'{plan.path}/{name}'))


def _dense_mlp(plan, x_GCD, w):
  """The experts' MLPs on per-expert blocks [G, C, D] (batched matmuls)."""
  return _expert_mlps(x_GCD, w, plan.activation, lambda x, name: quantize.batched(
      plan.quantization, f'{plan.path}/{name}', x, w[name]).astype(plan.dtype))


@dataclasses.dataclass(frozen=True)
class _Plan:
  """What a device's dispatch needs to know besides its arrays (static)."""
  num_experts: int
  expert_axes: tuple          # Mesh axes the experts split over (expert parallelism).
  parallel: int               # P: devices along them.
  capacity_factor: float
  buffer: float
  ragged: bool                # ragged_all_to_all (TPU, GPU) rather than fixed slabs.
  activation: str
  method: str
  dtype: Any
  quantization: quantize.Quantization = quantize.Quantization()
  path: str = ''              # The MoeBlock's: its kernels' parameters are path/name.


def _dispatch(plan: _Plan, x_TD, ids_TK, gates_TK, w):
  """One device's tokens through their experts: (outputs [T, D], the fraction of its
  routed rows dropped)."""
  t, k = ids_TK.shape
  n = t * k
  flat = ids_TK.reshape(n)
  order = jnp.argsort(flat, stable=True)            # Rows sorted by expert.
  expert_N = flat[order]
  rows_ND = x_TD[order // k]
  sizes_E = jnp.bincount(flat, length=plan.num_experts).astype(jnp.int32)
  if plan.capacity_factor:
    y_ND, kept_N = _by_capacity(plan, rows_ND, expert_N, sizes_E, w)
  elif plan.parallel == 1:
    y_ND, kept_N = _mlp(plan, rows_ND, sizes_E, w), None
  elif plan.ragged:
    y_ND, kept_N = _exchange_ragged(plan, rows_ND, expert_N, sizes_E, w)
  else:
    y_ND, kept_N = _exchange_slabs(plan, rows_ND, expert_N, sizes_E, w)
  y_ND = jnp.zeros_like(y_ND).at[order].set(y_ND)   # Back to token order.
  out_TD = jnp.einsum('TKD,TK->TD', y_ND.reshape(t, k, -1), gates_TK.astype(jnp.float32),
                      preferred_element_type=jnp.float32)
  dropped = 0.0 if kept_N is None else 1.0 - kept_N.sum() / n
  return out_TD.astype(plan.dtype), jnp.asarray(dropped, jnp.float32)


def _positions(expert_N, sizes_E):
  """Each sorted row's place within its group's rows (its expert's, or its device's)."""
  starts_E = jnp.cumsum(sizes_E) - sizes_E
  return jnp.arange(expert_N.shape[0]) - starts_E[expert_N]


def _by_capacity(plan, rows_ND, expert_N, sizes_E, w):
  """GShard's capacity: each expert's first C rows in [E, C, D] blocks, exchanged whole
  between expert-parallel devices by all_to_all."""
  n, e, p = rows_ND.shape[0], plan.num_experts, plan.parallel
  capacity = max(1, min(n, math.ceil(plan.capacity_factor * n / e)))  # Past n: room for all.
  pos_N = _positions(expert_N, sizes_E)
  kept_N = pos_N < capacity
  blocks_ECD = jnp.zeros((e, capacity, rows_ND.shape[1]), rows_ND.dtype).at[
      expert_N, pos_N].set(rows_ND, mode='drop')
  if p > 1:  # [P, E/P, C, D]: block j goes to device j; back as [E/P, P x C, D].
    local = e // p
    recv = jax.lax.all_to_all(blocks_ECD.reshape(p, local, capacity, -1), plan.expert_axes,
                              0, 0, tiled=True)
    mine = recv.transpose(1, 0, 2, 3).reshape(local, p * capacity, -1)
    out = _dense_mlp(plan, mine, w)
    out = out.reshape(local, p, capacity, -1).transpose(1, 0, 2, 3)
    blocks_ECD = jax.lax.all_to_all(out, plan.expert_axes, 0, 0, tiled=True).reshape(
        e, capacity, -1)
  else:
    blocks_ECD = _dense_mlp(plan, blocks_ECD, w)
  y_ND = blocks_ECD.at[expert_N, pos_N].get(mode='fill', fill_value=0)
  return jnp.where(kept_N[:, None], y_ND, 0), kept_N


def _local_groups(counts_SG, sent_S, starts_S, rows):
  """Received rows laid out source after source (source s's `sent_S[s]` rows from
  `starts_S[s]`, each source's in expert order, `counts_SG` its rows per local expert
  before any were turned away): each received row's local expert, or G where the row is
  empty."""
  g = counts_SG.shape[1]
  r = jnp.arange(rows)
  source = jnp.clip(jnp.searchsorted(starts_S, r, side='right') - 1, 0, len(sent_S) - 1)
  within = r - starts_S[source]
  ends_SG = jnp.cumsum(counts_SG, axis=1)
  expert = jax.vmap(lambda ends, j: jnp.searchsorted(ends, j, side='right'))(
      ends_SG[source], within)
  return jnp.where(within < sent_S[source], expert, g)


def _grouped_local(plan, recv_RD, expert_R, w):
  """The local experts' MLPs on received rows (expert_R: each row's local expert, or G
  for an empty row)."""
  g = plan.num_experts // plan.parallel
  order = jnp.argsort(expert_R, stable=True)
  sizes_G = jnp.bincount(expert_R, length=g + 1)[:g].astype(jnp.int32)
  y = _mlp(plan, recv_RD[order], sizes_G, w)
  return jnp.zeros_like(y).at[order].set(y)


def _exchange_slabs(plan, rows_ND, expert_N, sizes_E, w):
  """Expert parallelism by fixed slabs [P, S, D]: slab j holds the first S rows bound for
  device j (S: `buffer` x N / P, or N), all_to_all there and back."""
  n, p = rows_ND.shape[0], plan.parallel
  g = plan.num_experts // p
  slab = n if not plan.buffer else max(1, min(n, math.ceil(plan.buffer * n / p)))
  dest_N = expert_N // g
  counts_PG = sizes_E.reshape(p, g)
  pos_N = _positions(dest_N, counts_PG.sum(1))
  kept_N = pos_N < slab
  slabs = jnp.zeros((p, slab, rows_ND.shape[1]), rows_ND.dtype).at[dest_N, pos_N].set(
      rows_ND, mode='drop')
  recv = jax.lax.all_to_all(slabs, plan.expert_axes, 0, 0, tiled=True)        # [P, S, D]
  counts_SG = jax.lax.all_to_all(counts_PG, plan.expert_axes, 0, 0, tiled=True)
  sent_S = jnp.minimum(counts_SG.sum(1), slab)
  expert_R = _local_groups(counts_SG, sent_S, jnp.arange(p) * slab, p * slab)
  y = _grouped_local(plan, recv.reshape(p * slab, -1), expert_R, w).reshape(p, slab, -1)
  back = jax.lax.all_to_all(y, plan.expert_axes, 0, 0, tiled=True)
  y_ND = back.at[dest_N, pos_N].get(mode='fill', fill_value=0)
  return jnp.where(kept_N[:, None], y_ND, 0), kept_N


def _exchange_ragged(plan, rows_ND, expert_N, sizes_E, w):
  """Expert parallelism by ragged_all_to_all into a receive buffer of R rows (`buffer` x
  N, or P x N: the worst case). Senders fill a device's buffer in device order; rows that
  do not fit are dropped."""
  n, p = rows_ND.shape[0], plan.parallel
  g = plan.num_experts // p
  size = p * n if not plan.buffer else max(1, min(p * n, math.ceil(plan.buffer * n)))
  me = jax.lax.axis_index(plan.expert_axes)
  counts_SE = jax.lax.all_gather(sizes_E, plan.expert_axes, tiled=False)      # [P, E]
  want_SP = counts_SE.reshape(p, p, g).sum(2)             # Rows device s has for device d.
  before_SP = jnp.cumsum(want_SP, axis=0) - want_SP       # Sent to d by devices before s.
  sent_SP = jnp.clip(size - before_SP, 0, want_SP)        # What fits, in device order.
  at_SP = jnp.cumsum(sent_SP, axis=0) - sent_SP           # Where s's rows land on d.
  starts_SP = jnp.cumsum(want_SP, axis=1) - want_SP       # Where they start on s.
  out = jax.lax.ragged_all_to_all(
      rows_ND, jnp.zeros((size, rows_ND.shape[1]), rows_ND.dtype), starts_SP[me], sent_SP[me],
      at_SP[me], sent_SP[:, me], axis_name=plan.expert_axes)
  mine_SG = jax.lax.dynamic_slice_in_dim(counts_SE, me * g, g, axis=1)
  expert_R = _local_groups(mine_SG, sent_SP[:, me], at_SP[:, me], size)
  y = _grouped_local(plan, out, expert_R, w)
  back = jax.lax.ragged_all_to_all(
      y, jnp.zeros_like(rows_ND), at_SP[:, me], sent_SP[:, me], starts_SP[:, me],
      sent_SP[me], axis_name=plan.expert_axes)
  dest_N = expert_N // g
  return back, _positions(dest_N, want_SP[me]) < sent_SP[me][dest_N]


class MoeBlock(nn.Module):
  """Routed experts in place of a Transformer block's MLP: x [B, L, D] -> (y [B, L, D],
  the layer's router statistics). `mask_BL`: the tokens that count in the statistics
  (packed documents' padding does not)."""
  moe: Moe
  activation: str = 'swiglu'
  dtype: str = 'float32'
  quantization: quantize.Quantization = quantize.Quantization()

  @nn.compact
  def __call__(self, x_BLD: jax.Array, mask_BL: Optional[jax.Array] = None
               ) -> tuple[jax.Array, dict]:
    m, d = self.moe, x_BLD.shape[-1]
    e, f = m.num_experts, m.mlp_dim
    router_DE = param(self, 'router', (d, e), ('embed', 'experts'), jnp.float32)
    logits_BLE = jnp.einsum('BLD,DE->BLE', x_BLD.astype(jnp.float32), router_DE)
    gates_BLK, ids_BLK = route(logits_BLE, m.experts_per_token, m.norm_topk_prob)
    names = (('wi_gate', 'wi_up') if self.activation in ('swiglu', 'geglu') else ('wi',))
    w = {name: param(self, name, (e, d, f), ('experts', 'expert_embed', 'mlp'), self.dtype)
         for name in names}
    w['wo'] = param(self, 'wo', (e, f, d), ('experts', 'mlp', 'expert_embed'), self.dtype)
    y_BLD, dropped = _experts(x_BLD.astype(self.dtype), ids_BLK, gates_BLK, w, m,
                              self.activation, self.dtype, self.quantization, '/'.join(self.path))
    y_BLD = nn.with_logical_constraint(y_BLD, ('act_batch', 'act_len', 'act_embed'))
    return y_BLD, statistics(logits_BLE, ids_BLK, mask_BL, dropped)


def statistics(logits_BLE, ids_BLK, mask_BL, dropped) -> dict:
  """A layer's router figures over the tokens that count: `choice` [E] (the fraction of
  tokens choosing each expert; sums to k), `prob` [E] (its mean router probability), `z`
  (mean squared logsumexp), `entropy` (mean entropy of the router's distribution, nats) and
  `dropped` (the fraction of routed rows turned away)."""
  e = logits_BLE.shape[-1]
  mask = (jnp.ones(logits_BLE.shape[:2], jnp.float32) if mask_BL is None
          else mask_BL.astype(jnp.float32))
  total = jnp.maximum(mask.sum(), 1.0)
  mean = lambda v: jnp.einsum('BL...,BL->...', v, mask) / total
  logits = jax.lax.stop_gradient(logits_BLE)  # Only the two losses are differentiated.
  probs_BLE = jax.nn.softmax(logits_BLE, axis=-1)
  chosen_BLE = jax.nn.one_hot(ids_BLK, e, dtype=jnp.float32).sum(axis=2)
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  return {'choice': mean(chosen_BLE), 'prob': mean(probs_BLE),
          'z': mean(jnp.square(jax.nn.logsumexp(logits_BLE, axis=-1))),
          'entropy': mean(-(jnp.exp(log_probs) * log_probs).sum(-1)),
          'dropped': jax.lax.stop_gradient(dropped)}


def _experts(x_BLD, ids_BLK, gates_BLK, w, m: Moe, activation: str, dtype,
             quantization: quantize.Quantization = quantize.Quantization(), path: str = ''
             ) -> tuple:
  """The routed experts' outputs [B, L, D] and the fraction of rows dropped: each device's
  tokens dispatched under shard_map (module docstring)."""
  mesh = jax.sharding.get_abstract_mesh()
  logical = lambda *names: tuple(nn.logical_to_mesh_axes(names))
  b, l, d = x_BLD.shape
  # A dimension that does not divide over its mesh axes (init's and decoding's one row) is
  # replicated: each device then routes every token of it.
  token_axes = [axes if size % math.prod(mesh.shape[a] for a in axes) == 0 else ()
                for size, axes in zip((b, l), (mesh_axes_of(a) for a in logical(
                    'act_batch', 'act_len')))] if not mesh.empty else []
  expert_axes = mesh_axes_of(logical('experts')[0]) if not mesh.empty else ()
  mlp_axes = mesh_axes_of(logical('mlp')[0]) if not mesh.empty else ()
  parallel = math.prod(mesh.shape[a] for a in expert_axes) if expert_axes else 1
  plan = _Plan(m.num_experts, expert_axes, parallel, m.capacity_factor, m.buffer,
               ragged=platform() in RAGGED_ALL_TO_ALL, activation=activation,
               method=m.grouped_matmul, dtype=dtype, quantization=quantization, path=path)
  k = ids_BLK.shape[-1]

  def local(x_BLD, ids_BLK, gates_BLK, w):
    bl, ll = x_BLD.shape[:2]
    y_TD, dropped = _dispatch(plan, x_BLD.reshape(bl * ll, d), ids_BLK.reshape(bl * ll, k),
                              gates_BLK.reshape(bl * ll, k), w)
    return y_TD.reshape(1, bl, ll, d), dropped.reshape(1)
  if mesh.empty:
    y, dropped = local(x_BLD, ids_BLK, gates_BLK, w)
    return y[0], dropped[0]
  if set(mlp_axes) & {a for axes in token_axes for a in axes}:
    raise ValueError(f"routed experts need the tokens unsplit over the experts' hidden units' "
                     f'mesh axes {mlp_axes}; check the rules of act_batch and act_len')
  P = jax.sharding.PartitionSpec
  tokens = P(*(axes or None for axes in token_axes), None)
  weights = {name: P(expert_axes or None, None, mlp_axes or None) if name != 'wo'
             else P(expert_axes or None, mlp_axes or None, None) for name in w}
  # Each device's partial sums over its share of the hidden units, summed outside the
  # shard_map; the dropped fractions, one per device, are averaged.
  every = tuple(mesh.axis_names)
  partial = P(mlp_axes or None, *(axes or None for axes in token_axes), None)
  # check_vma=False: Pallas kernels (Megablox) carry no varying-axes types. Nothing inside
  # is a differentiated psum, and every output's spec names the axes it varies over.
  y, dropped = jax.shard_map(local, mesh=mesh, in_specs=(tokens, tokens, tokens, weights),
                             out_specs=(partial, P(every)), check_vma=False)(
                                 x_BLD, ids_BLK, gates_BLK, w)
  return y.sum(0) if y.shape[0] > 1 else y[0], dropped.mean()
