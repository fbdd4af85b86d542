"""Routed experts (zoo.models.moe): the layer equals a dense per-token reference on every
mesh, expert axis included, forward and gradients; drops are exactly the rows a capacity or
a bounded buffer turns away, and counted; the grouped matmuls agree; the router losses are
Hugging Face's; experiments/moe_lm.py resumes bit-exactly and on another mesh; the TPU
compiler gets Megablox and ragged all-to-all."""
import functools
import importlib.util
import math
import re
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import experiment, load_config, read_metrics, stop_at
from zoo.models import moe, transformer_lm
from zoo.parallel import mesh as mesh_lib
from zoo.parallel import sharding, topology
from zoo.run import config as cfg

needs_libtpu = pytest.mark.skipif(not importlib.util.find_spec('libtpu'), reason='needs libtpu')
needs_cuda = pytest.mark.skipif(not importlib.util.find_spec('jax_cuda12_plugin'),
                                reason="needs JAX's CUDA plugin ('.[cuda12]')")
E, K, D, F = 8, 2, 16, 16
# (mesh axes, shape, rules): data, tensor and FSDP meshes, and expert parallelism 4 ways
# (with FSDP; with the experts' hidden units split over 'model').
MESHES = {
    '(8,1)': (('batch', 'model'), (8, 1), sharding.standard_rules()),
    '(4,2)': (('batch', 'model'), (4, 2), sharding.standard_rules()),
    '(2,4) fsdp': (('batch', 'model'), (2, 4), sharding.fsdp_rules()),
    'expert 4 fsdp': (('batch', 'expert', 'model'), (2, 4, 1),
                      sharding.expert_rules(sharding.fsdp_rules())),
    'expert 4 x model 2': (('batch', 'expert', 'model'), (1, 4, 2),
                           sharding.expert_rules(sharding.standard_rules())),
}


@functools.lru_cache(maxsize=None)
def _inputs(seed=0, shape=(8, 4, D)):
  """Inputs and parameters of order 1 (decisive routing, outputs well above rounding), made
  once per shape in one program (numpy arrays: the tests' layers place them on their mesh)."""
  def make():
    x = jax.random.normal(jax.random.key(seed), shape)
    boxed = jax.eval_shape(lambda x: moe.MoeBlock(moe.Moe(E, K, F)).init(jax.random.key(1), x),
                           x)['params']
    keys = iter(jax.random.split(jax.random.key(2), 8))
    params = jax.tree.map(lambda p: jax.random.normal(next(keys), p.shape) / math.sqrt(
        p.shape[-2]), nn.meta.unbox(boxed))
    return params, x
  return jax.tree.map(np.asarray, jax.jit(make)())


def _reference(params, x, kept=None, norm_topk_prob=True):
  """Every expert on every token, weighted by the token's gates (0 where not chosen, or
  where `kept` [B, L, K] says its row was dropped)."""
  logits = jnp.einsum('BLD,DE->BLE', x, params['router'])
  gates, ids = moe.route(logits, K, norm_topk_prob)
  if kept is not None:
    gates = gates * kept
  weights = (jax.nn.one_hot(ids, E) * gates[..., None]).sum(2)
  h = nn.silu(jnp.einsum('BLD,EDF->BLEF', x, params['wi_gate'])) * jnp.einsum(
      'BLD,EDF->BLEF', x, params['wi_up'])
  return jnp.einsum('BLEF,EFD,BLE->BLD', h, params['wo'], weights)


@jax.jit
def _dense(params, x, kept=None):
  """The reference's output and the gradient of sum(y^2) with respect to params and x, in
  one program (the reference op by op would compile a program per op and shape)."""
  return _reference(params, x, kept), jax.grad(
      lambda p, x: jnp.sum(_reference(p, x, kept) ** 2), argnums=(0, 1))(params, x)


@jax.jit
def _routed(params, x):
  """The experts each token chooses [B, L, K], as the reference routes."""
  return moe.route(jnp.einsum('BLD,DE->BLE', x, params['router']), K, True)[1]


def _layer(settings, mesh_name=None, grad=True):
  """A function of (params, x) giving (y, statistics) and, with `grad`, the gradient of
  sum(y^2) with respect to params and x: the layer's forward as it runs alone and its
  gradient, in one program jitted on the named mesh (or without one)."""
  block = moe.MoeBlock(settings)
  fwd = lambda p, x: block.apply({'params': p}, x)
  both = lambda p, x: (fwd(p, x), jax.grad(lambda p, x: jnp.sum(fwd(p, x)[0] ** 2),
                                           argnums=(0, 1))(p, x))
  f = jax.jit(both if grad else fwd)
  if mesh_name is None:
    return f
  axes, shape, rules = MESHES[mesh_name]
  mesh = mesh_lib.make_mesh(shape, axes)
  rules = sharding.for_mesh(rules, axes)

  def run(*args):
    with sharding.scope(mesh, rules):
      return f(*args)
  return run


def _assert_close(got, want, what):
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5,
                               err_msg=f'{what}{jax.tree_util.keystr(path)}')


@pytest.mark.parametrize('mesh_name', sorted(MESHES))
def test_dropless_layer_equals_the_dense_reference(mesh_name, devices):
  """Forward and gradients (parameters and inputs) within float32 rounding of every
  expert run on every token, nothing dropped: data, tensor, FSDP and expert-parallel."""
  del devices
  params, x = _inputs()
  (y, stats), grads = _layer(moe.Moe(E, K, F), mesh_name)(params, x)
  want, want_grads = _dense(params, x)
  assert float(jnp.abs(want).mean()) > 0.1  # Far above the tolerance.
  _assert_close(y, want, 'y')
  _assert_close(grads, want_grads, 'grad')
  assert float(stats['dropped']) == 0.0


def _kept(ids, shards, limit, group_of):
  """Which rows [B, L, K] survive when each of `shards` equal blocks of the batch sorts
  its rows by expert (ties in token order) and keeps the first `limit` rows of each group
  (`group_of(expert)`: the expert itself for a capacity, its device for slabs)."""
  ids = np.asarray(ids)
  kept = np.zeros(ids.shape, bool)
  per = ids.shape[0] // shards
  for block in range(0, ids.shape[0], per):
    flat, seen = ids[block:block + per].reshape(-1), {}
    keep = np.zeros(flat.shape, bool)
    for i in np.argsort(flat, kind='stable'):
      seen[group_of(flat[i])] = seen.get(group_of(flat[i]), 0) + 1
      keep[i] = seen[group_of(flat[i])] <= limit
    kept[block:block + per] = keep.reshape(kept[block:block + per].shape)
  return kept


@pytest.mark.parametrize('mesh_name', ['(8,1)', 'expert 4 fsdp'])
def test_a_capacity_drops_exactly_the_rows_beyond_it_and_counts_them(mesh_name, devices):
  """capacity_factor 0.5: each device's experts keep their first C = 0.5 x rows / E rows;
  the output is the reference without the others, and `dropped` is their fraction."""
  del devices
  params, x = _inputs(shape=(8, 16, D))
  y, stats = _layer(moe.Moe(E, K, F, capacity_factor=0.5), mesh_name, grad=False)(params, x)
  rows = 16 * K  # One row of the batch per device, 16 tokens, 2 choices each.
  kept = _kept(_routed(params, x), 8, math.ceil(0.5 * rows / E), lambda e: e)
  assert 0 < (~kept).sum()
  _assert_close(y, _dense(params, x, kept)[0], 'y')
  assert float(stats['dropped']) == pytest.approx((~kept).mean())
  roomy = _layer(moe.Moe(E, K, F, capacity_factor=float(E)), mesh_name, grad=False)  # All fit.
  _assert_close(roomy(params, x)[0], _dense(params, x, np.ones_like(kept))[0], 'y')


def test_a_bounded_expert_buffer_drops_exactly_what_does_not_fit_and_counts_it(devices):
  """Expert parallelism over 4 devices with expert_buffer 0.5 (CPU: fixed slabs of
  0.5 x rows / 4 per pair of devices): the rows past a slab are dropped, and counted."""
  del devices
  params, x = _inputs(shape=(8, 16, D))
  (y, stats), grads = _layer(moe.Moe(E, K, F, buffer=0.5), 'expert 4 fsdp')(params, x)
  kept = _kept(_routed(params, x), 8, math.ceil(0.5 * 16 * K / 4), lambda e: e // (E // 4))
  assert 0 < (~kept).sum()
  want, want_grads = _dense(params, x, kept)
  _assert_close(y, want, 'y')
  assert float(stats['dropped']) == pytest.approx((~kept).mean())
  _assert_close(grads, want_grads, 'grad')


def test_megablox_interpreted_equals_ragged_dot(devices):
  """Megablox (interpreted off TPU) equals jax.lax.ragged_dot, forward and gradients, rows
  past the last group zero (an uneven row count is padded to its tile)."""
  del devices
  rows = jax.random.normal(jax.random.key(0), (40, 128))
  w = jax.random.normal(jax.random.key(1), (4, 128, 128)) / 10
  sizes = jnp.array([5, 0, 20, 9], jnp.int32)  # 34 of 40 rows in groups.
  out = {}
  for method in ('ragged_dot', 'megablox'):  # Each one's product and gradient: one program.
    f = lambda r, w, s, m=method: moe.grouped_matmul(r, w, s, m, jnp.float32)
    out[method] = jax.jit(lambda r, w, s, f=f: (f(r, w, s), jax.grad(
        lambda r, w: jnp.sum(f(r, w, s) ** 2), argnums=(0, 1))(r, w)))(rows, w, sizes)
  assert float(jnp.abs(out['megablox'][0][34:]).max()) == 0.0
  _assert_close(out['megablox'], out['ragged_dot'], 'megablox')


def test_router_losses_are_hugging_faces(devices):
  """The pooled load-balance loss equals transformers' load_balancing_loss_func over two
  layers (k = 2 when the router is uniform), and the z-loss is the mean squared logsumexp."""
  del devices
  torch = pytest.importorskip('torch')
  from transformers.models.mixtral import modeling_mixtral  # pylint: disable=import-outside-toplevel
  model = transformer_lm.TransformerLM(num_layers=2, d_model=D, num_heads=2, mlp_dim=F,
                                       vocab_size=16, max_len=8, num_experts=E,
                                       experts_per_token=K, router_aux_coef=0.5,
                                       router_z_coef=0.25)
  # Each layer's statistics of its router logits, pooled by router_losses: one program.
  losses = jax.jit(lambda logits: transformer_lm.router_losses(model, [
      moe.statistics(l, moe.route(l, K, True)[1], None, jnp.zeros(())) for l in logits]))
  logits = [np.asarray(jax.random.normal(jax.random.key(i), (2, 5, E))) * 2 for i in range(2)]
  aux, metrics = losses(logits)
  want = modeling_mixtral.load_balancing_loss_func(
      tuple(torch.tensor(l.reshape(-1, E)) for l in logits), E, K)
  assert float(metrics['moe/balance_loss']) == pytest.approx(float(want), rel=1e-5)
  z = np.mean([np.square(np.logaddexp.reduce(l.astype(np.float64), axis=-1)) for l in logits])
  assert float(metrics['moe/z_loss']) == pytest.approx(float(z), rel=1e-5)
  assert float(aux) == pytest.approx(0.5 * float(want) + 0.25 * float(z), rel=1e-5)
  uniform = [np.zeros((2, 5, E), np.float32)] * 2
  assert float(losses(uniform)[1]['moe/balance_loss']) == pytest.approx(K)


def test_the_plan_and_flops_count_the_experts_a_token_meets(devices):
  """The analytic FLOPs count k experts per token (not all E), so MFU is not inflated."""
  del devices
  dense = transformer_lm.TransformerLM(num_layers=2, d_model=D, num_heads=2, mlp_dim=2 * F,
                                       vocab_size=128, max_len=8, mlp_activation='swiglu')
  routed = dense.clone(num_experts=E, experts_per_token=K, expert_mlp_dim=F)
  # k experts of F units do a dense MLP of k F units' work, plus the router's D x E.
  want = transformer_lm.train_flops(dense, 4, 8) + 6 * 2 * D * E * 4 * 8
  assert transformer_lm.train_flops(routed, 4, 8) == want


@pytest.mark.parametrize('overrides,field', [
    ({'model.experts_per_token': 9}, 'model.experts_per_token'),
    ({'model.dense_layers': (0,), 'model.scan_layers': True}, 'model.scan_layers=False'),
    ({'model.dense_layers': (5,)}, 'must list layers in [0, 2)'),
    ({'model.grouped_matmul': 'cutlass'}, 'model.grouped_matmul'),
    ({'model.expert_buffer': -1.0}, 'model.expert_buffer'),
    ({'model.lora.rank': 4, 'model.lora.targets': ('query', 'wi_up')}, 'model.lora.targets'),
    ({'logical_axis_rules': [('experts', 'expurt')]}, 'logical_axis_rules'),
])
def test_bad_settings_name_their_field(overrides, field):
  with pytest.raises(cfg.ConfigError, match=re.escape(field)):
    cfg.validate(load_config('moe_lm', **overrides), 8)


def _losses(workdir):
  return {r['step']: r['train/loss'] for r in read_metrics(workdir) if 'train/loss' in r}


# moe_lm:smoke for 6 steps, each logged, evaluated and saved at the last.
STEPS = {'train.steps': 6, 'train.log_every_steps': 1, 'eval.every_steps': 6,
         'checkpoint.every_steps': 6}


@pytest.fixture(scope='module')
def straight(tmp_path_factory):
  """moe_lm:smoke,ep trained straight (one process of 8 devices, an expert axis of 4): the
  run the resumed runs and the two-process run must reproduce. Its workdir."""
  from zoo.run import train  # pylint: disable=import-outside-toplevel
  workdir = tmp_path_factory.mktemp('straight')
  train.train_and_evaluate(load_config('moe_lm', 'smoke,ep', **STEPS,
                                       **{'checkpoint.async_save': False}), str(workdir))
  return workdir


def test_moe_lm_resumes_bit_exactly_and_on_another_mesh(straight, tmp_path, monkeypatch,
                                                       devices):
  """moe_lm on an expert axis of 4, stopped (as by SIGTERM) during step 3 and resumed:
  every logged loss equals a straight run's exactly; resumed instead on a mesh without an
  expert axis (4, 2), it trains on within float32 rounding. Each row logs the router's
  figures."""
  del devices
  from zoo.run import train  # pylint: disable=import-outside-toplevel
  base = {**STEPS, 'checkpoint.async_save': False}
  stop_at(monkeypatch, 3)
  train.train_and_evaluate(load_config('moe_lm', 'smoke,ep', **base), str(tmp_path / 'resumed'))
  monkeypatch.undo()
  # The run stopped at step 3, twice: resumed on its mesh, and moved to another.
  shutil.copytree(tmp_path / 'resumed', tmp_path / 'moved')
  train.train_and_evaluate(load_config('moe_lm', 'smoke,ep', **base), str(tmp_path / 'resumed'))
  want = _losses(straight)
  assert _losses(tmp_path / 'resumed') == want and sorted(want) == list(range(1, 7))
  train.train_and_evaluate(load_config('moe_lm', 'smoke', **base, **{'mesh.shape': (4, 2)}),
                           str(tmp_path / 'moved'))
  moved = _losses(tmp_path / 'moved')
  np.testing.assert_allclose([moved[s] for s in range(4, 7)], [want[s] for s in range(4, 7)],
                             rtol=2e-5)
  row = [r for r in read_metrics(straight) if 'train/loss' in r][-1]
  for key in ('balance_loss', 'z_loss', 'dropped', 'layer_1/load_max', 'layer_1/load_min',
              'layer_1/entropy', 'layer_1/dropped'):
    assert np.isfinite(row[f'train/moe/{key}']), key
  assert row['train/moe/dropped'] == 0.0 and row['train/moe/layer_0/load_max'] >= 1.0


def _compiled_gradient(settings, devices, shape):
  """The compiled program of sum(y^2)'s gradient for a bf16 MoeBlock with `settings` on
  compile-only `devices`, mesh `shape` over ('batch', 'expert', 'model') with moe_lm's
  rules, a [8, 256, 512] input split over batch and expert: its HLO text."""
  axes = ('batch', 'expert', 'model')
  mesh = mesh_lib.make_mesh(shape, axes, devices, batch_axes=('batch', 'expert'))
  rules = sharding.for_mesh(sharding.expert_rules(sharding.fsdp_rules()), axes)
  block = moe.MoeBlock(settings, dtype='bfloat16')
  x = jax.ShapeDtypeStruct((8, 256, 512), jnp.bfloat16)
  boxed = jax.eval_shape(lambda x: block.init(jax.random.key(0), x), x)
  plain = jax.tree.map(lambda p: p.value, boxed, is_leaf=lambda p: isinstance(p, nn.Partitioned))
  with sharding.scope(mesh, rules):
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          plain, shardings)
    x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(('batch', 'expert'))))
    loss = lambda p, x: jnp.sum(block.apply(p, x)[0].astype(jnp.float32) ** 2)
    return jax.jit(jax.grad(loss)).lower(params, x).compile().as_text()


@needs_libtpu
def test_a_tpu_compiles_megablox_and_ragged_all_to_all(devices):
  """On v5p-8 (compile-only) with an expert axis of 4: the step's grouped matmuls are
  Megablox's kernels (gmm, and tgmm for the weights' gradient: no dense convolution), and
  the rows travel by ragged all-to-all."""
  del devices
  text = _compiled_gradient(moe.Moe(16, 2, 256), topology.devices(topology.parse('v5p-8')),
                            (1, 4, 1))
  kernels = re.findall(r'custom_call_target="tpu_custom_call".{0,400}?\b(t?gmm)\b', text)
  assert kernels.count('gmm') >= 3 and kernels.count('tgmm') >= 3, kernels
  assert text.count('ragged-all-to-all(') >= 2


@needs_libtpu
@pytest.mark.parametrize('name,shape,batch_alone_fails', [('v5p-64', (4, 8, 1), True),
                                                          ('v5litepod-256', (8, 32, 1), False)])
def test_an_expert_axis_on_a_pod_gives_every_process_one_block_of_rows(name, shape,
                                                                       batch_alone_fails):
  """The batch splits over ('batch', 'expert'): zoo's mesh sorts those positions together
  by process, so each host still feeds one block of rows, in process order (sorting the
  'batch' axis alone, as before, left v5p-64's hosts non-contiguous rows and no start)."""
  from zoo.data import feed  # pylint: disable=import-outside-toplevel
  devices = topology.devices(topology.parse(name))
  axes = ('batch', 'expert', 'model')
  spec = jax.sharding.PartitionSpec(('batch', 'expert'))
  mesh = mesh_lib.make_mesh(shape, axes, devices, batch_axes=('batch', 'expert'))
  batch = 2 * len(devices)
  rows = feed.rows_by_process(jax.sharding.NamedSharding(mesh, spec), batch)
  processes = sorted({d.process_index for d in devices})
  assert sorted(rows) == processes
  assert [rows[p].start for p in processes] == sorted(rows[p].start for p in processes)
  if batch_alone_fails:
    with pytest.raises(cfg.ConfigError, match='non-contiguous rows'):
      feed.rows_by_process(jax.sharding.NamedSharding(
          mesh_lib.make_mesh(shape, axes, devices), spec), batch)


@needs_cuda
def test_a_gpu_compiles_mosaic_gpu_grouped_matmuls(monkeypatch):
  """On H100s (compile-only) the experts' matmuls, forward and backward, are Mosaic GPU
  kernels (ragged dot, and the transposed ragged dot for the weights' gradient), not
  XLA's ragged_dot, which lowers to a dense masked dot there; with an expert axis over 8
  GPUs the rows travel by ragged all-to-all."""
  gpu = topology.devices(topology.parse('h100-1'))
  # The transposed kernel reads the SM count from jax.devices() as it traces.
  monkeypatch.setattr(jax, 'devices', lambda *args: gpu)
  text = _compiled_gradient(moe.Moe(8, 2, 256), gpu, (1, 1, 1))
  # Forward: gate, up, down; backward: the down projection's rows, and three weights'.
  assert len(re.findall(r'custom_call_target="mosaic_gpu', text)) >= 7
  # 8 GPUs, an expert axis of 8: the rows travel by ragged all-to-all (asynchronous there).
  gpus = topology.devices(topology.parse('h100-8'))
  monkeypatch.setattr(jax, 'devices', lambda *args: gpus)
  text = _compiled_gradient(moe.Moe(8, 2, 256, buffer=2.0), gpus, (1, 8, 1))  # One a GPU.
  assert text.count('ragged-all-to-all-start') >= 2
  assert len(re.findall(r'custom_call_target="mosaic_gpu', text)) >= 7


def test_the_plan_shows_the_experts_and_their_receive_buffer(devices):
  """--dry_run of moe_lm on an expert axis of 4: 2 experts per device, the rows each device
  routes, and a bounded receive buffer's rows, bytes and what happens past it."""
  del devices
  from zoo.run import plan  # pylint: disable=import-outside-toplevel
  config = load_config('moe_lm', 'smoke,ep', **{'model.expert_buffer': 2.0})
  text = plan.format_plan(plan.make_plan(config))
  rows = 16 // 8 * 32 * 2  # Each device's 2 of 16 rows (batch 2 x expert 4), 32 tokens, top 2.
  assert (f"8 experts, 2 per token (2 per device over mesh axes ('expert',)); {rows:,} rows "
          'routed per device') in text, text
  assert (f'receive buffer {2 * rows:,} rows (2.0 x the rows sent): '
          f'{2 * rows * 64 * 4 / 2**20:.2f} MiB per device; rows past it are dropped, counted '
          'in train/moe/dropped') in text, text


def _ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                       *, axis_name):
  """jax.lax.ragged_all_to_all's semantics from all_gather (XLA:CPU has no ragged
  all-to-all): source s's rows [input_offsets[d], + send_sizes[d]) land in device d's
  output from output_offsets[d] (the sender's numbers)."""
  del recv_sizes
  me = jax.lax.axis_index(axis_name)
  gather = lambda v: jax.lax.all_gather(v, axis_name, tiled=False)
  rows, start, size, at = gather(operand), gather(input_offsets), gather(send_sizes), gather(
      output_offsets)
  r = jnp.arange(output.shape[0])
  for s in range(rows.shape[0]):  # Each source's block, where the sender says.
    inside = (r >= at[s, me]) & (r < at[s, me] + size[s, me])
    taken = rows[s][jnp.clip(start[s, me] + r - at[s, me], 0, rows.shape[1] - 1)]
    output = jnp.where(inside[:, None], taken, output)
  return output


def _kept_in_buffers(ids, groups, parallel, size):
  """Which rows [B, L, K] a ragged receive buffer of `size` rows keeps: the batch's
  `groups` x `parallel` equal blocks, each group's devices sending, in device order, their
  rows for device d (in expert order) until d's buffer is full."""
  ids = np.asarray(ids)
  kept = np.zeros(ids.shape, bool)
  per = ids.shape[0] // (groups * parallel)
  local = E // parallel
  for g in range(groups):
    room = [size] * parallel
    for s in range(parallel):
      block = slice((g * parallel + s) * per, (g * parallel + s + 1) * per)
      flat = ids[block].reshape(-1)
      keep = np.zeros(flat.shape, bool)
      for i in np.argsort(flat, kind='stable'):
        d = flat[i] // local
        keep[i] = room[d] > 0
        room[d] -= 1
      kept[block] = keep.reshape(kept[block].shape)
  return kept


@pytest.mark.parametrize('buffer', [0.0, 0.75])
def test_the_ragged_exchange_of_tpus_and_gpus_equals_the_reference(buffer, monkeypatch, devices):
  """The expert-parallel exchange that TPUs and GPUs run (ragged_all_to_all, emulated here
  by its semantics): dropless it equals the dense reference, forward and gradients; with a
  buffer of 0.75 x the rows sent, the rows that do not fit (senders in device order) are
  dropped and counted."""
  del devices
  monkeypatch.setattr(moe, 'RAGGED_ALL_TO_ALL', ('cpu',))
  monkeypatch.setattr(jax.lax, 'ragged_all_to_all', _ragged_all_to_all)
  params, x = _inputs(shape=(8, 16, D))
  (y, stats), grads = _layer(moe.Moe(E, K, F, buffer=buffer), 'expert 4 fsdp')(params, x)
  kept = _kept_in_buffers(_routed(params, x), 2, 4,
                          math.ceil(buffer * 16 * K) if buffer else 4 * 16 * K)
  assert (~kept).any() == bool(buffer)
  want, want_grads = _dense(params, x, kept)
  _assert_close(y, want, 'y')
  assert float(stats['dropped']) == pytest.approx((~kept).mean())
  _assert_close(grads, want_grads, 'grad')


def test_experts_split_over_two_processes_train_as_one_process(straight, tmp_path, devices):
  """2 processes x 4 devices, an expert axis of 8 spanning both (each device one expert,
  rows crossing processes by all-to-all): the same losses as one process of 8 devices (the
  straight run, its experts over an axis of 4: the same math on every mesh)."""
  del devices
  from multihost_test import launch  # pylint: disable=import-outside-toplevel
  settings = {**STEPS, 'mesh.shape': (1, 8, 1), 'eval.sample': False}  # (data_multihost_test)
  result = launch(f'--config={experiment("moe_lm")}:smoke,ep', f'--workdir={tmp_path / "two"}',
                  *(f'--config.{k}={v}' for k, v in settings.items()))
  assert result.returncode == 0, result.stdout[-3000:]
  one, two = _losses(straight), _losses(tmp_path / 'two')
  assert sorted(two) == [1, 2, 3, 4, 5, 6]
  np.testing.assert_allclose([two[s] for s in sorted(two)], [one[s] for s in sorted(two)],
                             rtol=2e-5)
