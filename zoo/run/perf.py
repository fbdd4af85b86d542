"""FLOPs per step, the devices' peak, and model FLOPs utilisation (MFU).

Conventions (those of PaLM, arXiv:2204.02311, app. B, and MaxText):
- Model FLOPs per train step are 3x the forward pass's matmul and convolution FLOPs
  (2 per multiply-add; the backward pass costs twice the forward), for the global batch,
  counted from the forward's jaxpr with loops multiplied out. Elementwise work, softmax,
  normalisation and the optimizer are not counted, nor is recomputation (remat): MFU
  measures useful work. Convolutions count every output position times the whole kernel,
  padding included. For the decoder LM this is exactly its family's analytic count
  (zoo.models.transformer_lm.train_flops): 6 N tokens + 12 layers len d_model tokens,
  N the parameters of its matmuls (blocks and output head; the embedding lookup is not
  a matmul), the attention term counting the whole
  len x len score matrix, which the model computes before masking.
- XLA's own count (`xla_flops`) is the compiled step's cost analysis: per device, after
  partitioning, elementwise work included, but loop bodies (nn.scan layers, gradient
  accumulation) counted once.
- Peak: dense bfloat16 matmul FLOP/s per chip from the vendors' data sheets, whatever
  dtype the model computes in. CPU has no data sheet: its peak is a float32 matmul
  measured on this host, divided among the host's emulated devices (they share its
  cores). `config.perf.peak_flops_per_device` > 0 overrides both.
- MFU = model FLOPs per step / (step time x devices x peak per device).
"""
import math
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from zoo.run import steps

if TYPE_CHECKING:
  from zoo.run.setup import Setup

# device_kind substring -> dense bf16 FLOP/s per chip. Checked in order: more specific first.
PEAK_FLOPS = (
    ('TPU v4', 275e12),
    ('TPU v5 lite', 197e12), ('TPU v5e', 197e12),
    ('TPU v5p', 459e12), ('TPU v5', 459e12),
    ('TPU v6 lite', 918e12), ('TPU v6e', 918e12),
    ('A100', 312e12),
    ('H100 PCIe', 756e12), ('H100', 989e12),
    ('H200', 989e12),
)


def table_peak(device_kind: str) -> Optional[float]:
  """Data-sheet peak of a device kind (e.g. 'NVIDIA H100 80GB HBM3'), or None."""
  for key, flops in PEAK_FLOPS:
    if key.lower() in device_kind.lower():
      return flops
  return None


_MEASURED = {}


def measured_cpu_peak(size: int = 1024, repeats: int = 3) -> float:
  """Float32 matmul FLOP/s of one host device's [size, size] product, best of `repeats`.

  XLA's CPU matmuls use every core, so this is the host's peak; emulated devices share it.
  """
  if size not in _MEASURED:
    device = jax.local_devices()[0]
    with jax.set_mesh(jax.sharding.Mesh(np.array([device]), ('one',))):  # Not the run's mesh.
      a = jax.device_put(jnp.ones((size, size), jnp.float32), device)
      f = jax.jit(lambda x: x @ x)
      f(a).block_until_ready()
      best = math.inf
      for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    _MEASURED[size] = 2 * size**3 / best
  return _MEASURED[size]


def peak_flops(configured: float = 0.0) -> tuple[Optional[float], str]:
  """(peak FLOP/s per device, where it comes from); (None, reason) when unknown."""
  if configured > 0:
    return configured, 'config.perf.peak_flops_per_device'
  device = jax.local_devices()[0]
  if device.platform == 'cpu':
    n = jax.local_device_count()
    return measured_cpu_peak() / n, f'float32 matmul measured on this host, / {n} devices'
  flops = table_peak(device.device_kind)
  if flops is None:
    return None, (f'no peak known for {device.device_kind!r}: set '
                  'config.perf.peak_flops_per_device for MFU')
  return flops, f'bf16 data sheet, {device.device_kind}'


def _dot_flops(eqn):
  (contract, _), _ = eqn.params['dimension_numbers']
  lhs = eqn.invars[0].aval.shape
  return 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contract)


def _conv_flops(eqn):
  rhs = eqn.invars[1].aval.shape  # Kernel; its out-feature dimension is rhs_spec[0].
  out_features = rhs[eqn.params['dimension_numbers'].rhs_spec[0]]
  return 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(rhs) // out_features


def _subjaxprs(value):
  if hasattr(value, 'eqns'):
    yield value
  elif hasattr(value, 'jaxpr') and hasattr(value.jaxpr, 'eqns'):
    yield value.jaxpr
  elif isinstance(value, (tuple, list)):
    for v in value:
      yield from _subjaxprs(v)


def jaxpr_flops(jaxpr: Any) -> int:
  """Matmul and convolution FLOPs of a jaxpr; scan bodies count `length` times, a
  cond its costliest branch, a while loop's body once (its trip count is not static)."""
  total = 0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == 'dot_general':
      total += _dot_flops(eqn)
    elif name == 'conv_general_dilated':
      total += _conv_flops(eqn)
    elif name == 'cond':
      total += max(jaxpr_flops(b) for b in _subjaxprs(eqn.params['branches']))
    else:
      inner = sum(jaxpr_flops(j) for v in eqn.params.values() for j in _subjaxprs(v))
      total += inner * (eqn.params['length'] if name == 'scan' else 1)
  return total


def forward_flops(fn: Callable, *args) -> int:
  """Matmul and convolution FLOPs of `fn(*args)` (arrays or ShapeDtypeStructs), traced
  (under the caller's mesh and axis rules), not run."""
  return jaxpr_flops(jax.make_jaxpr(fn)(*args).jaxpr)


def xla_flops(compiled: Any) -> float:
  """FLOPs per device of a compiled program by XLA's cost analysis (loop bodies once); nan
  without one (a program the compiler refused)."""
  analysis = compiled.cost_analysis() if compiled is not None else None
  if isinstance(analysis, (list, tuple)):  # Older jax: one dict per program.
    analysis = analysis[0] if analysis else {}
  return float((analysis or {}).get('flops', float('nan')))


def mfu(flops_per_step: float, step_time: float, num_devices: int,
        peak_per_device: Optional[float]) -> float:
  if not peak_per_device or not step_time:
    return float('nan')
  return flops_per_step / (step_time * num_devices * peak_per_device)


def format_flops(x: Optional[float]) -> str:
  if x is None or not np.isfinite(x):
    return 'n/a'
  for unit, scale in (('P', 1e15), ('T', 1e12), ('G', 1e9), ('M', 1e6), ('k', 1e3)):
    if abs(x) >= scale:
      return f'{x / scale:.3g} {unit}FLOP'
  return f'{x:.3g} FLOP'


def step_cost(setup: 'Setup', state: Any, compiled: Any) -> dict:
  """FLOPs of one train step by this module's conventions, traced for `state` (arrays or
  their shapes), XLA's count of the `compiled` step, and the tokens a step trains on
  (sequence tasks)."""
  if getattr(setup.model, 'attention', 'xla') != 'xla':  # Fused kernels have no jaxpr FLOPs:
    state = state.replace(apply_fn=setup.model.clone(attention='xla').apply)  # the same math.

  def loss(params, state, batch):
    return steps.loss(params, state, batch, steps.dropout_key(setup.config.seed, state.step),
                      setup.task, setup.task.counted(batch))
  with setup.scope():
    forward = forward_flops(loss, state.params, state, setup.batch)
  cost = {'model_flops': 3 * forward, 'xla_flops_per_device': xla_flops(compiled),
          'devices': setup.mesh.size}
  tokens = setup.task.tokens(setup.batch)
  if tokens:
    cost['tokens'] = tokens
  if setup.family.analytic_flops:
    *rows, length = setup.batch['inputs'].shape  # [B, L], or preference pairs' [B, 2, L].
    cost['lm_analytic_flops'] = setup.family.analytic_flops(setup.model, math.prod(rows), length)
  return cost


def format_cost(cost: dict) -> str:
  """The log line of a step_cost (with the peak, if it has one)."""
  f = format_flops
  analytic = f', LM analytic {f(cost["lm_analytic_flops"])}' if 'lm_analytic_flops' in cost else ''
  line = (f'FLOPs per train step: {f(cost["model_flops"])} model (3 x forward matmuls{analytic}); '
          f'XLA cost analysis {f(cost["xla_flops_per_device"])} per device x {cost["devices"]} '
          '(loop bodies counted once)')
  if 'peak_source' in cost:
    line += '; peak ' + (f'{f(cost["peak_flops_per_device"])}/s per device ({cost["peak_source"]})'
                         if cost['peak_flops_per_device'] else cost['peak_source'])
  return line
