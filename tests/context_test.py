"""Context parallelism (a 'context' mesh axis): the sequence split over devices, keys and
values gathered, each row fed in the load-balanced order; the loss and gradients equal one
device's on every mesh, with packed documents, grouped-query attention, soft caps, sliding
windows and routed experts; the rules, the order and the checks."""
import functools
import importlib.util
import math
import os
import re
import shutil
import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
import pytest

from conftest import REPO, experiment, load_config, read_metrics, stop_at, trainer
from zoo.errors import ConfigError
from zoo.models import attention, transformer_lm
from zoo.parallel import context, sharding
from zoo.parallel import mesh as mesh_lib
from zoo.run import config as cfg, memory, plan, tasks
from zoo.run import setup as setup_lib

B, L, V = 4, 32, 61
BASE = dict(num_layers=2, d_model=48, num_heads=4, mlp_dim=64, vocab_size=V, max_len=L,
            positions='rotary', norm='rms', mlp_activation='swiglu', loss_chunks=2)
# mesh name -> (axes, shape, rules, the model's switches, packed documents). Each mesh
# tries other switches, so that every one runs split once without a compile per pair.
MESHES = {
    'batch 2 x context 4': (('batch', 'context', 'model'), (2, 4, 1), sharding.standard_rules(),
                            dict(num_kv_heads=2, sliding_window=6, global_every=2), True),
    'context 8': (('batch', 'context', 'model'), (1, 8, 1), sharding.standard_rules(),
                  dict(positions='learned', attn_softcap=5.0), False),
    'batch 2 x context 2 x model 2': (('batch', 'context', 'model'), (2, 2, 2),
                                      sharding.fsdp_rules(),
                                      dict(num_kv_heads=2, attn_softcap=5.0, sliding_window=6),
                                      True),
    'context 2 x expert 2 x batch 2': (('batch', 'expert', 'context', 'model'), (2, 2, 2, 1),
                                       sharding.expert_rules(sharding.fsdp_rules()),
                                       dict(num_experts=4, experts_per_token=2), True),
}


def _batch(packed):
  """Tokens, targets, a loss mask and, packed, documents of 5 to 15 tokens with their
  segments and positions (the last one padding: segment 0, masked)."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, V, (B, L + 1)).astype(np.int32)
  batch = {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:],
           'mask': np.ones((B, L), np.float32)}
  if packed:
    segments, positions = np.zeros((B, L), np.int32), np.zeros((B, L), np.int32)
    for row in range(B):
      start, doc = 0, 1
      while start < L - 4:
        n = min(int(rng.integers(5, 16)), L - 4 - start)
        segments[row, start:start + n], positions[row, start:start + n] = doc, np.arange(n)
        start, doc = start + n, doc + 1
    batch.update(segments=segments, positions=positions, mask=(segments > 0).astype(np.float32))
  return batch


def _loss(model, params, batch):
  """The mean of the counted targets' losses (plus the router's, with experts)."""
  out = model.apply({'params': params}, batch['inputs'], positions_BL=batch.get('positions'),
                    segments_BL=batch.get('segments'), targets_BL=batch['targets'])
  loss = (out['loss'] * batch['mask']).sum() / batch['mask'].sum()
  return loss + out.get('aux_loss', 0.0)


@functools.lru_cache(maxsize=None)
def _model(mesh_name):
  switches = MESHES[mesh_name][3]
  model = transformer_lm.TransformerLM(**{**BASE, **switches})
  boxed = jax.jit(model.init)(jax.random.key(0), np.zeros((1, L), np.int32))['params']
  return model, jax.tree.map(np.asarray, nn.meta.unbox(boxed))


@pytest.mark.parametrize('mesh_name', sorted(MESHES))
def test_split_sequences_give_one_devices_loss_and_gradients(mesh_name, devices):
  """On the mesh, the batch in the load-balanced order: the loss and every parameter's
  gradient within float32 rounding of one device's on the batch as it is; the keys and
  values are gathered over 'context', the activations never."""
  del devices
  axes, shape, rules, _, packed = MESHES[mesh_name]
  model, params = _model(mesh_name)
  batch = _batch(packed)
  grad = jax.value_and_grad(functools.partial(_loss, model))
  want_loss, want_grads = jax.jit(grad)(params, batch)
  mesh = mesh_lib.make_mesh(shape, axes)
  rules = sharding.for_mesh(rules, axes)
  shards = sharding.sequence_shards(mesh, rules)
  assert shards == dict(zip(axes, shape))['context']
  balanced = context.balance(batch, shards)
  with sharding.scope(mesh, rules):
    step = jax.jit(grad)
    loss, grads = step(params, balanced)
    text = step.lower(params, balanced).compile().as_text()
  np.testing.assert_allclose(loss, want_loss, rtol=2e-6)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path))
  # Gathered over 'context': each layer's keys and values, [B / batch shards, L, kv heads /
  # model shards, head size], the positions and segments their masks need, and (experts)
  # router figures; never an activation [.., L, D] nor [.., L, mlp].
  size = dict(zip(axes, shape))
  kv = [B // math.prod(size[a] for a in sharding.batch_mesh_axes(rules)), L,
        (model.num_kv_heads or model.num_heads) // size['model'], model.d_model // model.num_heads]
  gathered = [[int(d) for d in dims.split(',')] for dims in
              re.findall(r'=\s+f32\[([\d,]*)\]\S*\s+all-gather\(', text)]
  assert sum(dims == kv for dims in gathered) == 2 * model.num_layers, gathered
  assert not [d for d in gathered if model.d_model in d or model.mlp_dim in d], gathered


def test_the_balanced_order_pairs_head_and_tail_chunks():
  """Device i holds chunks i and 2 x shards - 1 - i (and natural_order undoes it); every
  field along the sequence moves with its positions; a length that does not split is
  refused in one line."""
  np.testing.assert_array_equal(context.balanced_order(8, 2), [0, 1, 6, 7, 2, 3, 4, 5])
  order = context.balanced_order(24, 3)
  blocks = order.reshape(3, 8)  # Each device's causal work: the sum of its positions + 1.
  assert len({int((b + 1).sum()) for b in blocks}) == 1
  np.testing.assert_array_equal(context.natural_order(order[None], 3, 1)[0], np.arange(24))
  batch = {'inputs': np.arange(8)[None] * 10, 'targets': np.arange(8)[None] + 1,
           'weights': np.ones(1)}
  out = context.balance(batch, 2)
  np.testing.assert_array_equal(out['positions'][0], [0, 1, 6, 7, 2, 3, 4, 5])
  np.testing.assert_array_equal(out['inputs'], out['positions'] * 10)
  np.testing.assert_array_equal(out['targets'], out['positions'] + 1)
  assert out['weights'] is batch['weights'] and context.balance(batch, 1) is batch
  with pytest.raises(ConfigError, match=r'^config\.data\.seq_len: .* use a multiple of 8$'):
    context.balanced_order(12, 4)


def test_context_rules_split_sequences_and_fsdp_weights_but_not_the_batch():
  """A mesh with 'context' and rules that do not name it: 'act_len' on it, FSDP's parameter
  axes over batch x context, the batch on 'batch' alone; without the axis, the rules as
  they were."""
  fsdp = sharding.fsdp_rules()
  rules = sharding.for_mesh(fsdp, ('batch', 'context', 'model'))
  to_mesh = lambda *names: tuple(nn.logical_to_mesh_axes(names, rules))
  assert to_mesh('act_batch', 'act_len', 'act_embed') == ('batch', 'context', None)
  assert to_mesh('act_batch', 'act_kv_len', 'act_kv_heads') == ('batch', None, 'model')
  assert to_mesh('embed', 'mlp') == (('batch', 'context'), 'model')
  assert sharding.for_mesh(fsdp, ('batch', 'model')) == fsdp
  mine = (('act_len', 'context'),) + fsdp  # Rules that name it are taken as they are.
  assert sharding.for_mesh(mine, ('batch', 'context', 'model')) == mine


def test_a_context_mesh_trains_the_batch_that_divides_over_batch_alone(devices):
  """char_lm on batch 2 x context 4 with 2 rows a step (fewer than the devices), fed
  load-balanced: the same losses as on one batch axis; a sequence that does not split into
  2 x 4 chunks, and a classifier, are refused in one line."""
  del devices
  tiny = {'model.d_model': 32, 'model.num_heads': 4, 'model.mlp_dim': 64, 'data.seq_len': 16,
          'model.max_len': 16, 'train.batch_size': 2, 'optimizer.warmup_steps': 0}
  split = trainer('char_lm', **tiny, **{'mesh.axes': ('batch', 'context', 'model'),
                                        'mesh.shape': (2, 4, 1)})
  plain = trainer('char_lm', **tiny, **{'mesh.shape': (2, 4)})
  assert split.batch(0)['positions'].shape == (2, 16)
  # Each device receives only its row's sequence slice, not the whole row.
  assert {x.data.shape for x in split.batch(0)['inputs'].addressable_shards} == {(1, 4)}
  np.testing.assert_allclose(split.run(3), plain.run(3), rtol=2e-5)
  assert ("sequence: 16 positions split 4 ways over ('context',), 4 per device; keys and values "
          'gathered in attention, rows fed load-balanced (8 chunks') in plan.format_plan(
              plan.make_plan(split.config))
  task, axes = split.setup.task, ('batch', 'context', 'model')
  mesh = jax.sharding.AbstractMesh((1, 4, 2), axes)
  rules = sharding.for_mesh(sharding.standard_rules(), axes)
  with pytest.raises(ConfigError, match=r"^config\.data\.seq_len: the batch field 'inputs' has 12 "
                     r'positions, .* use a multiple of 8$'):
    cfg.validate_sequence_split(task, {'inputs': np.zeros((1, 12), np.int32)}, mesh, rules)
  with pytest.raises(ConfigError, match=r'^config\.mesh\.axes: the rules split sequences over 4 '
                     r'devices .* task is classification'):
    cfg.validate_sequence_split(tasks.Task(), {}, mesh, rules)


def _losses(workdir):
  return {r['step']: r['train/loss'] for r in read_metrics(workdir) if 'train/loss' in r}


def test_a_context_run_resumes_exactly_and_moves_off_the_axis_and_back(tmp_path, monkeypatch,
                                                                        devices):
  """char_lm:smoke,long (64 positions over 'context') stopped during step 2 and resumed
  on its mesh: every loss equals a straight run's exactly; moved instead to a mesh without
  a context axis for steps 3-4 and back onto one for 5-6, it trains on within float32
  rounding."""
  del devices
  from zoo.run import train  # pylint: disable=import-outside-toplevel
  steps = {'train.steps': 6, 'train.log_every_steps': 1, 'eval.every_steps': 6,
           'checkpoint.every_steps': 6, 'checkpoint.async_save': False,
           'mesh.shape': (2, 4, 1), 'train.batch_size': 2, 'eval.max_batches': 1,
           'eval.sample': False, 'data.seq_len': 64, 'model.max_len': 64}
  run = lambda workdir, **more: train.train_and_evaluate(
      load_config('char_lm', 'smoke,long', **{**steps, **more}), str(tmp_path / workdir))
  run('straight')
  stop_at(monkeypatch, 2)
  run('resumed')
  shutil.copytree(tmp_path / 'resumed', tmp_path / 'moved')
  monkeypatch.undo()
  run('resumed')
  want = _losses(tmp_path / 'straight')
  assert _losses(tmp_path / 'resumed') == want and sorted(want) == list(range(1, 7))
  stop_at(monkeypatch, 4)
  run('moved', **{'mesh.axes': ('batch', 'model'), 'mesh.shape': (2, 4)})
  monkeypatch.undo()
  run('moved')
  moved = _losses(tmp_path / 'moved')
  np.testing.assert_allclose([moved[s] for s in range(3, 7)], [want[s] for s in range(3, 7)],
                             rtol=2e-5)


@pytest.mark.skipif(not importlib.util.find_spec('jax_cuda12_plugin'),
                    reason="needs JAX's CUDA plugin ('.[cuda12]')")
def test_an_h100_host_compiles_a_context_parallel_step():
  """h100-8, compile-only: char_lm:smoke in bfloat16 over batch 2 x context 4; the plan
  names XLA's attention in each layer (cuDNN's partitioner takes no split sequence) and the
  collectives: keys and values gathered over 'context', their gradients reduce-scattered."""
  env = {k: v for k, v in os.environ.items() if k not in ('XLA_FLAGS', 'JAX_PLATFORMS')}
  result = subprocess.run(
      [sys.executable, '-m', 'zoo.main', '--dry_run', '--topology=h100-8',
       f'--config={experiment("char_lm")}:smoke', "--config.mesh.axes=('batch','context','model')",
       '--config.mesh.shape=(2,4,1)', '--config.model.dtype=bfloat16',
       '--config.data.seq_len=256', '--config.model.max_len=256'],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  out = result.stdout
  assert re.search(r'xla +block_0/attn, block_1/attn \(not its kernel: .*split the sequence', out)
  assert re.search(r'all-gather +\d+ x, groups of 4 \(context\)', out), out[-1500:]
  assert re.search(r'reduce-scatter +\d+ x, groups of 4 \(context\)', out), out[-1500:]


def test_max_batch_counts_rows_that_span_the_context_axis(monkeypatch, devices):
  """--max_batch on batch 2 x context 4: a stand-in compiler fits up to 3 rows per 4
  devices, so the largest global batch is 6, fewer rows than devices (0.75 per device)."""
  del devices
  asked = []

  def probe(setup, per_device):
    asked.append(per_device)
    fits = per_device <= 3
    return {'train': memory.Compiled(memory={'peak': per_device * 2**20}) if fits else
            memory.Compiled(refusal='RESOURCE_EXHAUSTED: Ran out of memory on HBM', needed=2**40)}
  monkeypatch.setattr(plan, '_probe', probe)
  config = load_config('char_lm', 'smoke,long', **{'mesh.shape': (2, 4, 1), 'train.batch_size': 2})
  found = plan.max_batch(config, device_memory_gib=1)
  assert (found['global_batch'], found['batch_per_device']) == (6, 0.75), found
  assert asked[0] == 1 and found['refused_at'] == 1  # 8 rows: one per device.
  assert plan.format_max_batch(found).startswith(
      'largest train batch that fits: 0.75 per device (train.batch_size=6)')


@pytest.mark.skipif(not importlib.util.find_spec('libtpu'), reason='needs libtpu')
def test_each_pod_host_places_only_its_devices_slices_of_the_sequence():
  """v5p-16 (2 hosts x 4 chips) over context 8: both hosts build the batch's 2 rows, and
  each places only the positions its chips hold (the torus interleaves the hosts along
  'context'); the sequence fields are split on input, the per-row weights are not."""
  from zoo.parallel import topology  # pylint: disable=import-outside-toplevel
  config = load_config('char_lm', 'smoke,long', **{
      'mesh.shape': (1, 8, 1), 'train.batch_size': 2, 'eval.batch_size': 2})
  s = setup_lib.checked(config, topology.devices(topology.parse('v5p-16')), plan=True)
  fed = s.placement.blocks(2)
  assert fed['rows'] == {0: [0, 2], 1: [0, 2]}
  assert fed['positions'] == {p: [[a, a + 32] for a in range(32 * p, 256, 64)] for p in (0, 1)}
  assert {k: v.sharding.shard_shape(v.shape) for k, v in s.eval_batch().items()} == {
      'inputs': (2, 32), 'targets': (2, 32), 'positions': (2, 32), 'weights': (2,)}
  assert plan._hosts({'hosts': {'processes': 2, 'devices_per_process': 4, **fed}})[1] == (
      "  of those rows' positions (in their load-balanced order), each places only: "
      '0: 0-31 64-95 128-159 192-223, 1: 32-63 96-127 160-191 224-255')


@pytest.mark.skipif(not importlib.util.find_spec('libtpu'), reason='needs libtpu')
def test_a_tpu_pod_runs_splash_on_a_split_sequence():
  """v5p-8, compile-only, char_lm:smoke,long (512 positions) over context 4 (attention
  'auto'): every layer runs the splash kernel on its load-balanced rows, the step holds its
  TPU custom calls, keys and values are gathered over 'context' and their gradients
  reduce-scattered."""
  from zoo.parallel import topology  # pylint: disable=import-outside-toplevel
  config = load_config('char_lm', 'smoke,long', **{
      'mesh.shape': (1, 4, 1), 'train.batch_size': 1, 'eval.batch_size': 1,
      'data.seq_len': 512, 'model.max_len': 512})
  from zoo.parallel import hlo  # pylint: disable=import-outside-toplevel
  s = setup_lib.checked(config, topology.devices(topology.parse('v5p-8')), plan=True)
  with s.scope(), attention.recording() as chosen:
    text = s.jit_train_step().lower(s.abstract_state(), s.batch).compile().as_text()
  assert set(chosen.values()) == {('splash', '')}, chosen
  assert text.count('custom_call_target="tpu_custom_call"') >= 3  # Forward, dq and dkv.
  kinds = {(c['kind'], c['axes']) for c in hlo.collectives(text, s.mesh)}
  assert kinds >= {('all-gather', 'context'), ('reduce-scatter', 'context')}, kinds


def test_initialising_on_a_split_mesh_stages_the_masks(devices):
  """model.init (under eval_shape, as Setup does) from a host batch of packed rows on a
  context mesh: the position and segment masks are staged, not built in NumPy ([1, L, L]
  booleans: 64 MiB at 8,192 positions, 16 GiB at 131,072)."""
  del devices
  import tracemalloc  # pylint: disable=import-outside-toplevel
  length, axes = 8192, ('batch', 'context', 'model')
  model = transformer_lm.TransformerLM(**{**BASE, 'max_len': length})
  rows = {'inputs': np.zeros((1, length), np.int32), 'positions': np.zeros((1, length), np.int32),
          'segments': np.ones((1, length), np.int32)}
  mesh = mesh_lib.make_mesh((1, 8, 1), axes)
  with sharding.scope(mesh, sharding.for_mesh(sharding.standard_rules(), axes)):
    tracemalloc.start()
    jax.eval_shape(lambda: model.init(jax.random.key(0), rows['inputs'],
                                      positions_BL=rows['positions'], segments_BL=rows['segments']))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
  assert peak < 2**24, peak
