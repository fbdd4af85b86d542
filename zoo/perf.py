"""FLOPs per step, the devices' peak, and model FLOPs utilisation (MFU).

Conventions (those of PaLM, arXiv:2204.02311, app. B, and MaxText):
- Model FLOPs per train step are 3x the forward pass's matmul and convolution FLOPs
  (2 per multiply-add; the backward pass costs twice the forward), for the global batch,
  counted from the forward's jaxpr with loops multiplied out. Elementwise work, softmax,
  normalisation and the optimizer are not counted, nor is recomputation (remat): MFU
  measures useful work. Convolutions count every output position times the whole kernel,
  padding included. For the decoder LM this is exactly `lm_train_flops`: 6 N tokens +
  12 layers len d_model tokens, N the parameters of its matmuls (blocks and output
  head; the embedding lookup is not a matmul), the attention term counting the whole
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

import jax
import jax.numpy as jnp
import numpy as np

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


def table_peak(device_kind):
  """Data-sheet peak of a device kind (e.g. 'NVIDIA H100 80GB HBM3'), or None."""
  for key, flops in PEAK_FLOPS:
    if key.lower() in device_kind.lower():
      return flops
  return None


_MEASURED = {}


def measured_cpu_peak(size=1024, repeats=3):
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


def peak_flops(configured=0.0):
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


def jaxpr_flops(jaxpr):
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


def forward_flops(fn, *args):
  """Matmul and convolution FLOPs of `fn(*args)` (arrays or ShapeDtypeStructs), traced
  (under the caller's mesh and axis rules), not run."""
  return jaxpr_flops(jax.make_jaxpr(fn)(*args).jaxpr)


def lm_train_flops(model, batch_size, seq_len):
  """Analytic train-step FLOPs of zoo's TransformerLM (see the module docstring)."""
  from zoo.models.transformer_lm import padded_vocab_size  # pylint: disable=import-outside-toplevel
  d, f = model.d_model, model.mlp_dim
  matmul_params = model.num_layers * (4 * d * d + 2 * d * f) + d * padded_vocab_size(model.vocab_size)
  tokens = batch_size * seq_len
  return 6 * matmul_params * tokens + 12 * model.num_layers * seq_len * d * tokens


def xla_flops(compiled):
  """FLOPs per device of a compiled program by XLA's cost analysis (loop bodies once)."""
  analysis = compiled.cost_analysis()
  if isinstance(analysis, (list, tuple)):  # Older jax: one dict per program.
    analysis = analysis[0] if analysis else {}
  return float((analysis or {}).get('flops', float('nan')))


def mfu(flops_per_step, step_time, num_devices, peak_per_device):
  if not peak_per_device or not step_time:
    return float('nan')
  return flops_per_step / (step_time * num_devices * peak_per_device)


def format_flops(x):
  if x is None or not np.isfinite(x):
    return 'n/a'
  for unit, scale in (('P', 1e15), ('T', 1e12), ('G', 1e9), ('M', 1e6), ('k', 1e3)):
    if abs(x) >= scale:
      return f'{x / scale:.3g} {unit}FLOP'
  return f'{x:.3g} FLOP'
