"""Low-precision matmuls (model.quantization): a Transformer's block projections in int8 or
fp8, forward and backward, with dynamic per-channel scales.

- 'int8': weights, activations and incoming gradients in int8 (int32 accumulation);
- 'fp8': weights and activations in float8_e4m3fn, incoming gradients in float8_e5m2 (the
  recipe of Transformer Engine, torchao and MaxText's fp8_full).
Each operand is scaled per channel (its axes that are not contracted) by its absolute
maximum, computed afresh at every call: there are no scales to keep, checkpoint or go stale
under gradient accumulation. The backward pass's two matmuls take the forward pass's
quantized operands, the incoming gradient rescaled and quantized per channel (quantized
training, straight-through: the rounding itself is not differentiated). The matmuls'
outputs come back in the computation dtype.

What is quantized: the block projections whose parameter path (as the run's parameter
table writes it: 'blocks/attn/query', 'block_3/mlp/wo', 'blocks/moe/wi_gate') one of
`model.quantize_modules`' regular expressions matches in full: attention's query, key,
value and out, the MLP's (and a shared expert's), and routed experts' grouped matmuls where
their kernel is jax.lax.ragged_dot or blocks at a capacity (Megablox and Mosaic GPU take
no quantized operands: those stay in the computation dtype, said once). Never: the
embedding, the LM head, routers, norms, attention's scores and weighted values (activations
times activations), LoRA's adapters.

Built on qwix's quantized-training ops (dot_general_qt, ragged_dot_qt), called here at
zoo's one projection einsum: qwix's model interception tells weights from activations by
tracing back to the parameter, which its einsum path cannot do on this JAX, and by shape,
which same-shaped query, key and value projections defeat.
"""
import dataclasses
import re
from typing import Optional

from absl import logging
import jax
import jax.numpy as jnp
from qwix._src.core import dot_general_qt, ragged_dot_qt  # Pinned: pyproject.toml.

from zoo.errors import fail

KINDS = ('none', 'int8', 'fp8')
# (forward type: weights and activations, backward type: incoming gradients).
TYPES = {'int8': (jnp.int8, jnp.int8), 'fp8': (jnp.float8_e4m3fn, jnp.float8_e5m2)}
# The parameters whose matmuls can be quantized, by the end of their path.
PROJECTIONS = re.compile(r'(.*/)?((cross_)?attn/(query|key|value|out)|'
                         r'(mlp|shared_expert|moe)/(wi|wi_gate|wi_up|wo))')
_SAID: set = set()


@dataclasses.dataclass(frozen=True)
class Quantization:
  """model.quantization and model.quantize_modules, as the model's layers take them."""
  kind: str = 'none'
  modules: tuple = ('.*',)

  def applies(self, path: str) -> bool:
    """Whether the projection whose parameter is at `path` runs quantized."""
    return (self.kind != 'none' and PROJECTIONS.fullmatch(path) is not None
            and any(re.fullmatch(rule, path) for rule in self.modules))


def einsum(q: Quantization, path: str, ins: str, outs: str, x: jax.Array,
           w: jax.Array) -> jax.Array:
  """x [B, L, *ins] times the kernel at `path`, w [*ins, *outs] -> [B, L, *outs], quantized
  if `q` applies to it."""
  if not q.applies(path):
    return jnp.einsum(f'BL{ins},{ins}{outs}->BL{outs}', x, w)
  contracted = tuple(range(len(ins)))
  return _dot(q, x, w, ((tuple(2 + a for a in contracted), contracted), ((), ())))


def batched(q: Quantization, path: str, x_GCD: jax.Array, w_GDF: jax.Array) -> jax.Array:
  """Per-group blocks [G, C, D] times their group's kernel [G, D, F] -> [G, C, F] in float32
  (routed experts at a capacity), quantized if `q` applies to `path`."""
  if not q.applies(path):
    return jnp.einsum('GCD,GDF->GCF', x_GCD, w_GDF, preferred_element_type=jnp.float32)
  return _dot(q, x_GCD, w_GDF, (((2,), (1,)), ((0,), (0,)))).astype(jnp.float32)


def _dot(q: Quantization, x: jax.Array, w: jax.Array, numbers) -> jax.Array:
  """qwix's quantized-training dot_general: both operands in the forward type, each incoming
  gradient in the backward type; the result in x's dtype."""
  fwd, bwd = TYPES[q.kind]
  config = dot_general_qt.DotGeneralQtConfig(lhs_qtype=fwd, rhs_qtype=fwd,
                                             dlhs_grad_qtype=bwd, drhs_grad_qtype=bwd)
  return dot_general_qt.dot_general_qt(x, w, numbers, config).astype(x.dtype)


def ragged_dot(q: Quantization, path: str, rows_ND: jax.Array, w_GDF: jax.Array,
               sizes_G: jax.Array) -> Optional[jax.Array]:
  """jax.lax.ragged_dot of rows sorted by group and their groups' kernels, quantized, in
  float32; None where `q` does not apply to `path` (the caller's own matmul runs). qwix's
  ragged_dot scales the kernels per output column over every group given (the experts a
  device holds): unlike the other matmuls', these scales change with the expert axis."""
  if not q.applies(path):
    return None
  fwd, bwd = TYPES[q.kind]
  config = ragged_dot_qt.RaggedDotQtConfig(lhs_qtype=fwd, rhs_qtype=fwd, dlhs_grad_qtype=bwd,
                                           drhs_grad_qtype=bwd)
  # In float32: its backward returns gradients in its preferred type, float32, which the
  # casts' own backward turns back into the operands' (bf16 ones would not mix).
  return ragged_dot_qt.ragged_dot_qt(rows_ND.astype(jnp.float32), w_GDF.astype(jnp.float32),
                                     sizes_G, config, None, jnp.float32)


def not_taken(q: Quantization, path: str, kernel: str) -> None:
  """Says once per kernel that routed experts `q` would quantize stay in the computation
  dtype, their grouped matmul (`kernel`) taking no quantized operands."""
  if q.applies(path) and (q.kind, kernel) not in _SAID:
    _SAID.add((q.kind, kernel))
    logging.warning("model.quantization=%r: routed experts' %s grouped matmul takes no "
                    'quantized operands: they stay in the computation dtype (e.g. %s; '
                    "model.grouped_matmul='ragged_dot' quantizes them)", q.kind, kernel, path)


def summary(kind: str, quantized: list, kept: list = ()) -> str:
  """What runs quantized, in one line ('' for 'none'): the types, and the projections by
  their place in a block, with how many blocks each is quantized in."""
  if kind == 'none':
    return ''
  fwd, bwd = (jnp.dtype(t).name for t in TYPES[kind])
  places = {}
  for path in quantized:  # 'block_3/attn/query' -> 'attn/query'; scanned 'blocks/...' too.
    places.setdefault(path.split('/', 1)[-1], []).append(path)
  shown = ', '.join(f'{place} (x{len(where)})' for place, where in places.items())
  line = (f'model.quantization={kind!r}: {fwd} weights and activations, {bwd} gradients, '
          f'per-channel absmax scales, on {len(quantized)} projection kernels: {shown}')
  if kept:
    line += (f'; kept in the computation dtype ({len(kept)}: their grouped matmul takes no '
             "quantized operands; model.grouped_matmul='ragged_dot' does)")
  return line


def check_modules(rules) -> None:
  """config.model.quantize_modules: regular expressions over parameter paths."""
  if not isinstance(rules, (tuple, list)) or not rules or not all(
      isinstance(r, str) for r in rules):
    fail('model.quantize_modules', "must be regular expressions over the projections' "
         f"parameter paths (e.g. ('blocks/mlp/.*',); default ('.*',): all), got {rules!r}")
  for rule in rules:
    try:
      re.compile(rule)
    except re.error as e:
      fail('model.quantize_modules', f'{rule!r} is not a regular expression ({e})')


def refusal(kind: str, device: jax.Device) -> str:
  """Why `device` cannot run `kind`'s matmuls ('' if it can); CPUs emulate both."""
  if kind == 'none' or device.platform == 'cpu':
    return ''
  if device.platform == 'tpu':
    generation = re.search(r'(\d+)', device.device_kind)
    if kind == 'fp8' and (not generation or int(generation.group(1)) < 7):
      return (f"{device.device_kind} has no fp8 matmuls (TPU7x does); use 'int8', which "
              'its matrix units run')
    return ''
  found = re.fullmatch(r'(\d+)\.(\d+)', str(getattr(device, 'compute_capability', '')))
  if not found:  # Not an NVIDIA GPU: its fp8 types, if any, are not e4m3fn and e5m2.
    return (f'{device.device_kind} reports no CUDA compute capability: zoo quantizes for '
            "NVIDIA GPUs (Turing and up for int8, Ada and Hopper for fp8); use 'none'")
  capability = float(found.group(0))
  if kind == 'fp8' and capability < 8.9:
    return (f'{device.device_kind} (compute capability {capability:g}) has no fp8 tensor '
            "cores (Ada and Hopper, 8.9 and up, do); use 'int8'")
  if kind == 'int8' and capability < 7.5:
    return (f'{device.device_kind} (compute capability {capability:g}) has no int8 tensor '
            "cores (7.5 and up); use 'none'")
  return ''
