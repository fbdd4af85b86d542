"""FLOPs per step (zoo.run.perf's conventions), the peak table, and MFU's ingredients."""
import jax
import jax.numpy as jnp
import pytest

from conftest import load_config
from zoo import data
from zoo.parallel import mesh as mesh_lib
from zoo.run import perf, setup


def _one_device_cost(compiled=True, **overrides):
  """step_cost of char_lm:smoke on one device (no partitioning in XLA's count); without
  `compiled`, only the traced counts."""
  config = load_config('char_lm', **{'mesh.shape': (1, 1), **overrides})
  dataset = data.load(config.data, config.seed)
  mesh = mesh_lib.make_mesh((1, 1), config.mesh.axes, devices=jax.devices()[:1])
  s = setup.build(config, dataset, mesh=mesh)
  with s.scope():
    abstract = s.abstract_state()
    lowered = s.jit_train_step().lower(abstract, s.batch)
  return perf.step_cost(s, abstract, lowered.compile() if compiled else lowered)


def test_lm_flops_match_the_analytic_count(devices):
  """Model FLOPs (3 x the traced forward's matmuls) equal 6 N tokens + 12 layers len d tokens
  exactly; XLA's cost analysis of the compiled step counts elementwise work, softmax,
  layer norm and AdamW too: within 10% above it at this size (measured: +6.3%)."""
  del devices
  cost = _one_device_cost()
  # char_lm:smoke: 2 layers, d 64, MLP 128, vocab padded to 128, batch 16 x 32 tokens.
  n = 2 * (4 * 64 * 64 + 2 * 64 * 128) + 64 * 128
  analytic = 6 * n * 16 * 32 + 12 * 2 * 32 * 64 * 16 * 32
  assert cost['lm_analytic_flops'] == analytic
  assert cost['model_flops'] == analytic
  assert cost['tokens'] == 16 * 32
  assert analytic <= cost['xla_flops_per_device'] <= 1.10 * analytic, cost


@pytest.mark.parametrize('overrides', [{'model.scan_layers': True}, {'model.remat': 'full'},
                                       {'train.microbatches': 4}])
def test_model_flops_do_not_depend_on_scan_remat_or_microbatches(overrides, devices):
  """Loops are multiplied out and recomputation is not useful work: the same count."""
  del devices
  cost = _one_device_cost(compiled=False, **overrides)
  assert cost['model_flops'] == cost['lm_analytic_flops']


def test_jaxpr_flops_multiply_scan_bodies_and_count_convolutions():
  x, w = jnp.ones((8, 32)), jnp.ones((5, 32, 32))
  scanned = lambda x, w: jax.lax.scan(lambda c, wi: (c @ wi, None), x, w)[0]
  assert perf.forward_flops(scanned, x, w) == 5 * 2 * 8 * 32 * 32
  image, kernel = jnp.ones((2, 8, 8, 3)), jnp.ones((3, 3, 3, 16))
  conv = lambda x, k: jax.lax.conv_general_dilated(x, k, (1, 1), 'SAME',
                                                   dimension_numbers=('NHWC', 'HWIO', 'NHWC'))
  assert perf.forward_flops(conv, image, kernel) == 2 * (2 * 8 * 8 * 16) * (3 * 3 * 3)
  cond = lambda p, x: jax.lax.cond(p, lambda: x @ x.T, lambda: jnp.zeros((8, 8)))
  assert perf.forward_flops(cond, True, x) == 2 * 8 * 8 * 32


def test_peak_table_and_precedence(devices):
  del devices
  assert perf.table_peak('NVIDIA H100 80GB HBM3') == 989e12
  assert perf.table_peak('NVIDIA H100 PCIe') == 756e12
  assert perf.table_peak('NVIDIA A100-SXM4-80GB') == 312e12
  assert perf.table_peak('NVIDIA H200') == 989e12
  assert perf.table_peak('TPU v4') == 275e12
  assert perf.table_peak('TPU v5 lite') == 197e12
  assert perf.table_peak('TPU v5p') == 459e12
  assert perf.table_peak('TPU v6 lite') == 918e12
  assert perf.table_peak('Quantum Abacus') is None
  assert perf.peak_flops(1e12) == (1e12, 'config.perf.peak_flops_per_device')
  measured, source = perf.peak_flops(0.0)  # CPU: this host's matmul, shared by 8 devices.
  assert measured > 1e8 and '/ 8 devices' in source
  assert perf.mfu(4e9, 2.0, 8, 1e9) == 0.25
