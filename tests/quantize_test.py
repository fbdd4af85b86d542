"""Low-precision matmuls (model.quantization): each quantized layer's output and gradients
equal a float64 reference of per-channel absmax quantization with quantized backward matmuls
(and, in fp8, exact float32 products on inputs fp8 represents); the compiled step holds the
low-precision dots it should (lowered here, compiled for a TPU and, with JAX's CUDA plugin, an
H100); what the hardware cannot run is refused in one line; the switch composes with scanned
layers, remat, microbatches, LoRA, routed experts and a context axis; checkpoints restore
with and without it; a non-finite value is not masked."""
import collections
import importlib.util
import logging
import re
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from conftest import load_config, read_metrics
from zoo import data
from zoo.errors import ConfigError
from zoo.models import quantize
from zoo.parallel import hlo, topology
from zoo.run import config as cfg
from zoo.run import setup as setup_lib
from zoo.run import sampling, train

# (forward type's largest magnitude, backward type's, how a scaled value is stored).
FORMATS = {
    # qwix's int8 bound is 127.5, so that the top bucket is whole: a channel's absmax, 127.5
    # once scaled, lands on either side of the half (127 or -128) by float32 rounding.
    'int8': (127.5, 127.5, lambda v: np.clip(np.round(v), -128, 127)),
    'fp8': (448.0, 57344.0, None),
}
ALL = quantize.Quantization('int8')


def _store(kind, v, backward=False):
  """v (already scaled) as the low-precision type stores it, back in float64."""
  if kind == 'int8':
    return FORMATS['int8'][2](v)
  fmt = ml_dtypes.float8_e5m2 if backward else ml_dtypes.float8_e4m3fn
  bound = FORMATS['fp8'][1 if backward else 0]
  return np.clip(v, -bound, bound).astype(np.float32).astype(fmt).astype(np.float64)


def _quantized(kind, a, axis, backward=False):
  """(a quantized over `axis` as stored, the scales broadcast along it): per-channel absmax,
  the channels being every other axis; in float32 as XLA computes it (it multiplies by
  reciprocals where the code divides: the scale by 1 / bound, the values by 1 / scale)."""
  a = np.asarray(a, np.float32)
  scale = np.abs(a).max(axis=axis, keepdims=True) * np.float32(1 / FORMATS[kind][int(backward)])
  scale = np.where(scale == 0, np.float32(1), scale)
  scaled = a * (np.float32(1) / scale)
  return _store(kind, scaled.astype(np.float64), backward), scale.astype(np.float64)


def reference(kind, x, w, g):
  """x [M, K] @ w [K, N] and its gradients for cotangent g [M, N], as quantized training
  computes them, in float64: the forward on both operands quantized per channel; each
  backward matmul on the forward's quantized operand, the incoming gradient first scaled by
  that operand's scales, then quantized per channel of its own."""
  x, w, g = (np.asarray(a, np.float32) for a in (x, w, g))
  qx, sx = _quantized(kind, x, 1)   # Per row.
  qw, sw = _quantized(kind, w, 0)   # Per output column.
  y = (qx @ qw) * sx * sw
  qg, sg = _quantized(kind, g * sw.astype(np.float32), 1, backward=True)
  dx = (qg @ qw.T) * sg
  qg2, sg2 = _quantized(kind, g * sx.astype(np.float32), 0, backward=True)
  dw = (qx.T @ qg2) * sg2
  return y, dx, dw


def _vjp(fn, x, w, g):
  y, pull = jax.vjp(fn, x, w)
  return (y, *pull(g))


# Each quantized layer's einsum: (path, ins, outs, x shape, w shape): attention's projections
# in and out, the MLP's.
LAYERS = {'attention query': ('blocks/attn/query', 'D', 'NH', (2, 6, 32), (32, 4, 8)),
          'attention out': ('block_1/attn/out', 'NH', 'D', (2, 6, 4, 8), (4, 8, 32)),
          'mlp': ('block_0/mlp/wi', 'D', 'F', (2, 6, 32), (32, 48))}


@pytest.mark.parametrize('kind', ['int8', 'fp8'])
@pytest.mark.parametrize('layer', list(LAYERS))
def test_a_quantized_projection_equals_the_reference(kind, layer):
  """Output, input gradient and weight gradient against the float64 reference to float32
  rounding; far from the unquantized ones (the guard against a switch that does nothing)."""
  path, ins, outs, x_shape, w_shape = LAYERS[layer]
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], x_shape)
  w = jax.random.normal(keys[1], w_shape) / 4
  y_shape = x_shape[:2] + w_shape[len(ins):]
  g = jax.random.normal(keys[2], y_shape)
  q = quantize.Quantization(kind)
  got = _vjp(lambda x, w: quantize.einsum(q, path, ins, outs, x, w), x, w, g)
  m, k, n = x_shape[0] * x_shape[1], int(np.prod(w_shape[:len(ins)])), int(np.prod(y_shape[2:]))
  want = reference(kind, np.reshape(x, (m, k)), np.reshape(w, (k, n)), np.reshape(g, (m, n)))
  plain = _vjp(lambda x, w: quantize.einsum(quantize.Quantization(), path, ins, outs, x, w),
               x, w, g)
  for name, a, b, c in zip(('output', 'input gradient', 'weight gradient'), got, want, plain):
    np.testing.assert_allclose(np.reshape(a, b.shape), b, rtol=2e-5, atol=2e-5 * np.abs(b).max(),
                               err_msg=name)
    error = np.abs(np.asarray(c) - np.asarray(a)).max() / np.abs(b).max()
    assert error > 1e-3, (name, error)  # Quantization's own error, which float32 lacks.


@pytest.mark.parametrize('routing', ['grouped', 'capacity'])
def test_quantized_experts_equal_the_reference(routing):
  """Routed experts at a capacity (per-group blocks [G, C, D], a batched matmul: each group
  against the reference) and dropless (jax.lax.ragged_dot over rows sorted by group, whose
  scales follow qwix's ragged_dot: the kernel's per output column over every group, the
  weight gradient's incoming gradient per column over every row)."""
  keys = jax.random.split(jax.random.key(1), 3)
  w = jax.random.normal(keys[1], (4, 16, 24)) / 4
  q = quantize.Quantization('int8')
  if routing == 'capacity':
    x = jax.random.normal(keys[0], (4, 6, 16))
    g = jax.random.normal(keys[2], (4, 6, 24))
    y, dx, dw = _vjp(lambda x, w: quantize.batched(q, 'blocks/moe/wo', x, w), x, w, g)
    for i in range(4):
      for a, b in zip((y[i], dx[i], dw[i]), reference('int8', x[i], w[i], g[i])):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5 * np.abs(b).max())
    return
  sizes = np.array([5, 0, 7, 4])  # An empty group; no row past the last.
  x = jax.random.normal(keys[0], (16, 16))
  g = jax.random.normal(keys[2], (16, 24))
  got = _vjp(lambda x, w: quantize.ragged_dot(q, 'blocks/moe/wi', x, w, jnp.asarray(
      sizes, jnp.int32)), x, w, g)
  group = np.repeat(np.arange(4), sizes)  # Each row's group.
  qx, sx = _quantized('int8', x, 1)
  qw, sw = _quantized('int8', w, (0, 1))   # [1, 1, N]: over every group.
  y = np.einsum('mk,mkn->mn', qx, qw[group]) * sx * sw[0]
  qg, sg = _quantized('int8', np.asarray(g) * sw[0].astype(np.float32), 1, backward=True)
  dx = np.einsum('mn,mkn->mk', qg, qw[group]) * sg
  qg2, sg2 = _quantized('int8', np.asarray(g) * sx.astype(np.float32), 0, backward=True)
  dw = np.stack([qx[group == i].T @ qg2[group == i] for i in range(4)]) * sg2
  for name, a, b in zip(('output', 'input gradient', 'weight gradient'), got, (y, dx, dw)):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5 * np.abs(b).max(), err_msg=name)
  np.testing.assert_array_equal(got[2][1], 0)  # The empty group's kernel: no gradient.


def _representable(key, shape, fmt, bound, axis, power):
  """Values `fmt` holds, each channel (along `axis`) reaching `bound` once, times 2**power:
  what per-channel absmax scaling maps to the type exactly."""
  a = np.asarray(jax.random.normal(key, shape) * bound / 8, np.float32).astype(fmt)
  a = np.clip(a.astype(np.float64), -bound, bound)
  np.put_along_axis(a, np.zeros([1 if i == axis else s for i, s in enumerate(shape)], int),
                    bound, axis)
  return a * 2.0**power


def test_fp8_is_exact_on_values_it_represents():
  """Inputs e4m3 represents (each row of x and column of w reaching 448 at one power of two)
  and a gradient e5m2 represents (each row and column reaching 57,344): output and both
  gradients equal float64's matmuls to float32 rounding. (int8 has no such inputs here:
  qwix scales by absmax / 127.5, so a channel's absmax itself is rounded to 127.)"""
  keys = jax.random.split(jax.random.key(2), 3)
  x = _representable(keys[0], (16, 32), ml_dtypes.float8_e4m3fn, 448.0, 1, -3)
  w = _representable(keys[1], (32, 24), ml_dtypes.float8_e4m3fn, 448.0, 0, -5)
  g = _representable(keys[2], (16, 24), ml_dtypes.float8_e5m2, 57344.0, 1, -12)
  g[0, :] = 57344.0 * 2.0**-12  # Each column reaches the bound too (the weight gradient's).
  q = quantize.Quantization('fp8')
  got = _vjp(lambda x, w: quantize.einsum(q, 'blocks/mlp/wi', 'D', 'F', x[None], w)[0],
             jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), jnp.asarray(g, jnp.float32))
  for name, a, b in zip(('output', 'input gradient', 'weight gradient'), got,
                        (x @ w, g @ w.T, x.T @ g)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * np.abs(b).max(), err_msg=name)


def test_a_non_finite_input_is_not_masked():
  """An infinite activation makes the quantized output and gradients non-finite (as the
  unquantized ones are): nothing sanitizes it, so the loop's check stops the run."""
  x = jnp.ones((1, 2, 8)).at[0, 0, 3].set(jnp.inf)
  w = jnp.ones((8, 4))
  y, dx, dw = _vjp(lambda x, w: quantize.einsum(ALL, 'blocks/mlp/wi', 'D', 'F', x, w), x, w,
                   jnp.ones((1, 2, 4)))
  assert not np.isfinite(np.asarray(y)).all() and not np.isfinite(np.asarray(dw)).all()


def _dot_types(text):
  """Counter of (operand type, operand type) of the low-precision dots in lowered StableHLO."""
  found = collections.Counter()
  for line in re.findall(r'stablehlo\.dot_general[^\n]*', text):
    types = tuple(re.findall(r'x(i8|f8E4M3FN|f8E5M2|bf16|f32)>', line.split(' : ')[-1])[:2])
    if set(types) & {'i8', 'f8E4M3FN', 'f8E5M2'}:
      found[types] += 1
  return found


def _lowered(devices_used, **overrides):
  config = load_config(overrides.pop('experiment', 'char_lm'), overrides.pop('arg', 'smoke'),
                       **overrides)
  cfg.validate(config, len(devices_used or jax.devices()))
  s = setup_lib.checked(config, devices_used, plan=True)
  with s.scope():
    return s.jit_train_step().lower(s.abstract_state(), s.batch).as_text(), s


# (overrides, low-precision dots: 3 a kernel, forward and both gradients, per layer traced).
COMPOSED = {
    'unrolled': ({}, {('i8', 'i8'): 36}),                   # 2 layers x 6 kernels x 3.
    'scan, remat, 2 microbatches': ({'model.scan_layers': True, 'model.remat': 'dots_no_batch',
                                     'train.microbatches': 2}, {('i8', 'i8'): 18}),
    'fp8: e4m3 forward, e5m2 gradients': ({'model.quantization': 'fp8'},
                                          {('f8E4M3FN', 'f8E4M3FN'): 12,
                                           ('f8E5M2', 'f8E4M3FN'): 24}),
    'mlp only': ({'model.quantize_modules': ('.*/mlp/.*',)}, {('i8', 'i8'): 12}),
    # The frozen base takes no weight gradient, nor the first attention an input gradient.
    'LoRA: adapters in float': ({'model.lora.rank': 4}, {('i8', 'i8'): 21}),
    'context axis': ({'arg': 'smoke,long', 'mesh.shape': (2, 4, 1)}, {('i8', 'i8'): 36}),
    'routed experts': ({'experiment': 'moe_lm', 'model.grouped_matmul': 'ragged_dot'},
                       {('i8', 'i8'): 42}),  # Attention's 24, the experts' 3 kernels' 18.
    'expert axis': ({'experiment': 'moe_lm', 'arg': 'smoke,ep',
                     'model.grouped_matmul': 'ragged_dot'}, {('i8', 'i8'): 42}),
    'routed experts in bf16': ({'experiment': 'moe_lm', 'model.grouped_matmul': 'ragged_dot',
                                'model.dtype': 'bfloat16'}, {('i8', 'i8'): 42}),
}


@pytest.mark.parametrize('case', list(COMPOSED))
def test_the_step_holds_its_low_precision_dots(case, devices):
  """Lowered for this CPU: each quantized kernel's forward and two gradient matmuls are
  low-precision dots, in every composition; none is left in float. (LoRA trains adapters
  only: the frozen base takes no weight gradient.)"""
  del devices
  overrides, want = COMPOSED[case]
  text, _ = _lowered(None, **{'model.quantization': 'int8', **overrides})
  assert _dot_types(text) == want


def test_a_tpu_compiles_int8_dots_and_refuses_fp8():
  """v5p (compile-only): the compiled step's 36 block matmuls are s8 x s8 convolutions (the
  TPU compiler's dots); fp8 is refused in one line naming the field and what works."""
  chips = topology.devices(topology.parse('v5p-8'))
  _, s = _lowered(chips, **{'model.quantization': 'int8', 'mesh.shape': (4, 1),
                            'model.dtype': 'bfloat16'})
  with s.scope():
    text = s.jit_train_step().lower(s.abstract_state(), s.batch).compile().as_text()
  assert hlo.matmul_types(text)[('s8', 's8')] == 36
  with pytest.raises(ConfigError, match=r"config\.model\.quantization: 'fp8': TPU v5 has no fp8 "
                     r"matmuls \(TPU7x does\); use 'int8'"):
    _lowered(chips, **{'model.quantization': 'fp8', 'mesh.shape': (4, 1)})


@pytest.mark.skipif(not importlib.util.find_spec('jax_cuda12_plugin'),
                    reason="needs JAX's CUDA plugin ('.[cuda12]') to compile for a GPU target")
@pytest.mark.parametrize('kind,low', [('int8', {('s8', 's8')}),
                                      ('fp8', {('f8e4m3fn', 'f8e4m3fn'), ('f8e5m2', 'f8e4m3fn')})])
def test_an_h100_compiles_low_precision_gemms_and_an_a100_refuses_fp8(kind, low):
  """h100-1 (compile-only): besides the head's and the embedding's four, every dot of the
  step is low-precision (XLA merges some of the backward's); a100 refuses fp8."""
  gpus = topology.devices(topology.parse('h100-1'))
  _, s = _lowered(gpus, **{'model.quantization': kind, 'mesh.shape': (1, 1),
                           'model.dtype': 'bfloat16'})
  with s.scope():
    dots = hlo.matmul_types(s.jit_train_step().lower(s.abstract_state(), s.batch).compile()
                          .as_text())
  assert sum(n for t, n in dots.items() if t not in low) == 4, dots
  if kind == 'fp8':
    with pytest.raises(ConfigError, match='A100.*compute capability 8.*no fp8 tensor cores'):
      _lowered(topology.devices(topology.parse('a100-1')), **{'model.quantization': 'fp8',
                                                              'mesh.shape': (1, 1)})


@pytest.mark.parametrize('platform,kind,capability,runs', [
    ('tpu', 'TPU v4', None, ('int8',)), ('tpu', 'TPU v5 lite', None, ('int8',)),
    ('tpu', 'TPU v5', None, ('int8',)), ('tpu', 'TPU v6 lite', None, ('int8',)),
    ('tpu', 'TPU7x', None, ('int8', 'fp8')),
    ('gpu', 'NVIDIA H100 80GB HBM3', '9.0', ('int8', 'fp8')),
    ('gpu', 'NVIDIA GeForce RTX 4090', '8.9', ('int8', 'fp8')),
    ('gpu', 'NVIDIA A100-SXM4-80GB', '8.0', ('int8',)),
    ('gpu', 'Tesla V100-SXM2-16GB', '7.0', ()),
    ('gpu', 'AMD Instinct MI300X', 'gfx942', ()), ('cpu', 'cpu', None, ('int8', 'fp8'))])
def test_what_each_device_runs(platform, kind, capability, runs):
  """fp8 on TPU7x and CUDA 8.9 and up, int8 on every TPU and CUDA 7.5 and up, both
  emulated on CPUs; each refusal a sentence naming the device and what works there."""
  device = types.SimpleNamespace(platform=platform, device_kind=kind,
                                 compute_capability=capability)
  for quantization in ('int8', 'fp8'):
    why = quantize.refusal(quantization, device)
    assert (not why) == (quantization in runs), (quantization, why)
    assert not why or why.startswith(kind), why
  assert not quantize.refusal('none', device)


def test_sampling_evaluating_and_importing_are_refused_too(monkeypatch, devices):
  """setup.placed (zoo.sample, zoo.evaluate, zoo.convert import) checks the devices as a run
  does: an fp8 run sampled where fp8 does not run is refused there, in one line."""
  del devices
  monkeypatch.setattr(quantize, 'refusal', lambda kind, device: 'no fp8 here' * (kind == 'fp8'))
  config = load_config('char_lm', **{'model.quantization': 'fp8'})
  with pytest.raises(ConfigError, match=r"config\.model\.quantization: 'fp8': no fp8 here"):
    setup_lib.placed(config, data.load(config.data, config.seed))


def test_experts_on_a_kernel_without_quantized_operands_stay_and_are_said(devices):
  """moe_lm on v5p-8 runs Megablox: its experts' kernels stay in the computation dtype, and
  the summary says so beside the attention kernels it quantizes."""
  del devices
  _, s = _lowered(topology.devices(topology.parse('v5p-8')),
                  **{'experiment': 'moe_lm', 'model.quantization': 'int8', 'mesh.shape': (4, 1)})
  quantized, kept = setup_lib.quantized(s)
  assert all('/attn/' in p for p in quantized) and len(quantized) == 8
  assert sorted(p.split('/', 1)[1] for p in kept) == ['moe/wi_gate', 'moe/wi_gate', 'moe/wi_up',
                                                       'moe/wi_up', 'moe/wo', 'moe/wo']
  assert 'kept in the computation dtype (6: their grouped matmul takes no quantized operands' in (
      quantize.summary('int8', quantized, kept))


def test_rules_that_match_nothing_are_refused(devices):
  del devices
  with pytest.raises(ConfigError, match=r"config\.model\.quantize_modules: \('attention/\.\*',\) "
                     "match none of the model's projection kernels"):
    _lowered(None, **{'model.quantization': 'int8', 'model.quantize_modules': ('attention/.*',)})
  with pytest.raises(ConfigError, match=r"model\.quantize_modules: '\(' is not a regular"):
    cfg.validate(load_config('char_lm', **{'model.quantize_modules': ('(',)}), 8)


def test_checkpoints_restore_across_the_switch_and_the_run_says_what_it_quantized(
    tmp_path, devices, caplog):
  """An int8 run logs what it quantized, saves at step 4 and is resumed to step 6 without
  quantization (the parameters are the same arrays); int8's losses are not float's."""
  del devices
  steps = {'train.steps': 4, 'train.log_every_steps': 1, 'checkpoint.every_steps': 2,
           'eval.every_steps': 100, 'eval.sample': False, 'model.dtype': 'bfloat16'}
  with caplog.at_level(logging.INFO, logger='absl'):
    train.train_and_evaluate(load_config('char_lm', **steps, **{'model.quantization': 'int8'}),
                             str(tmp_path / 'run'))
  assert ("model.quantization='int8': int8 weights and activations, int8 gradients, per-channel "
          'absmax scales, on 12 projection kernels: attn/key (x2), attn/out (x2), attn/query '
          '(x2), attn/value (x2), mlp/wi (x2), mlp/wo (x2)\n') in caplog.text
  # Decoding with the key/value cache quantizes as the step did (activations per token).
  cached, recomputed = (sampling.generate(str(tmp_path / 'run'), ['The '], 8, temperature=0.0,
                                          **kw)[0]['ids'] for kw in ({}, {'decoding': 'recompute'}))
  assert cached == recomputed
  resumed = train.train_and_evaluate(load_config('char_lm', **{**steps, 'train.steps': 6}),
                                     str(tmp_path / 'run'))
  assert int(resumed.step) == 6
  train.train_and_evaluate(load_config('char_lm', **steps), str(tmp_path / 'float'))
  losses = lambda d: [r['train/loss'] for r in read_metrics(d) if 'train/loss' in r]
  quantized, plain = losses(tmp_path / 'run')[:4], losses(tmp_path / 'float')
  assert quantized[0] == pytest.approx(plain[0], rel=1e-2)  # The same model, rounded.
  assert quantized != plain


def test_another_mesh_and_microbatches_give_the_same_first_loss(tmp_path, devices):
  """The first step's loss of an int8 run on (8, 1), and on (4, 2) in 2 microbatches: the
  same to 2e-4. Scales are per row of activations and per column of kernels, computed at
  each call: no microbatch sees another's (stale) scales (that would be ~1e-2), and how the
  devices split a dense block's rows or heads changes no scale (routed experts' do change
  with an expert axis: zoo.models.quantize.ragged_dot). (Not to float32's 1e-7: a channel's
  absmax, at the int8 bound's half once scaled, rounds to 127 or -128 as each program's
  fused division rounds: 3e-5 between these.)"""
  del devices
  first = {}
  for name, overrides in {'(8, 1)': {}, '(4, 2), 2 microbatches': {
      'mesh.shape': (4, 2), 'train.microbatches': 2}}.items():
    config = load_config('char_lm', **{'train.steps': 1, 'eval.every_steps': 100,
                                       'eval.sample': False, 'model.quantization': 'int8',
                                       **overrides})
    train.train_and_evaluate(config, str(tmp_path / name))
    first[name] = read_metrics(tmp_path / name)[0]['train/loss']
  assert first['(4, 2), 2 microbatches'] == pytest.approx(first['(8, 1)'], rel=2e-4), first
