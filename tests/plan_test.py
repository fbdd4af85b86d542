"""--dry_run: the plan's numbers are the compiled step's, and it runs and writes nothing."""
import jax
import numpy as np
import pytest

from conftest import load_config, run_cli, trainer, experiment
from zoo.parallel import hlo
from zoo.run import memory, plan


def _device0_bytes(tree):
  return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(tree))


@pytest.mark.parametrize('name', ['char_lm', 'resnet_digits'])
def test_plan_matches_the_compiled_step_and_the_real_state(name, devices):
  del devices
  overrides = {'mesh.shape': (2, 4)}
  p = plan.make_plan(load_config(name, **overrides))
  t = trainer(name, **overrides)  # The real state and step of the same config.
  with t.scope():
    memory = t.train_step.lower(t.state, t.batch(0)).compile().memory_analysis()
  # The peak: arguments and outputs, less the outputs that reuse donated arguments, plus
  # temporaries and code.
  peak = (memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
          + memory.temp_size_in_bytes + memory.generated_code_size_in_bytes)
  assert p['compiled_memory'] == {
      'arguments': memory.argument_size_in_bytes, 'outputs': memory.output_size_in_bytes,
      'aliased': memory.alias_size_in_bytes, 'temporaries': memory.temp_size_in_bytes,
      'code': memory.generated_code_size_in_bytes, 'peak': peak}
  assert memory.alias_size_in_bytes > 0 and memory.temp_size_in_bytes > 0  # Each term counts.
  held = p['bytes_per_device']
  assert held['params'] == _device0_bytes(t.state.params)
  assert held['optimizer'] == _device0_bytes(t.state.opt_state)
  assert held['model_state'] == _device0_bytes(t.state.model_state)
  assert (held['model_state'] > 0) == (name == 'resnet_digits')
  # The step's arguments are exactly the state and the batch.
  assert sum(held.values()) == p['compiled_memory']['arguments']
  assert p['step_cost']['model_flops'] > 0 and p['fits'] is None
  # The verdict: a budget a byte above the peak fits, a byte below does not (the budget
  # given to make_plan, as --dry_run --device_memory_gib does; then the same plan judged).
  verdict = plan.make_plan(load_config(name, **overrides), (peak - 1) / 2**30)
  assert verdict['fits'] is False and verdict['device_memory_bytes'] == peak - 1
  assert {**verdict, 'device_memory_bytes': None, 'fits': None, 'compile_s': 0,
          'eval_compile_s': 0} == {**p, 'compile_s': 0, 'eval_compile_s': 0}
  verdict = plan.judged(p, (peak + 1) / 2**30)
  assert verdict['fits'] is True and verdict['device_memory_bytes'] == peak + 1


def test_the_verdict_takes_the_smaller_of_the_budget_and_the_usable_memory():
  """A plan is judged against --device_memory_gib and what the devices allow (a TPU
  target's usable HBM, a GPU's), whichever is smaller; with neither, there is no verdict."""
  gib = 2**30
  p = {'refusal': None, 'compiled_memory': {'peak': 5 * gib}, 'totals': {'train': 5 * gib,
       'eval': 3 * gib}, 'usable_bytes': 10 * gib, 'usable_source': "the TPU compiler's usable HBM"}
  assert plan.judged(p)['fits'] is True
  assert plan.judged(p, 6)['fits'] is True
  assert plan.judged(p, 4)['fits'] is False  # The budget is the smaller limit.
  assert plan.verdict(plan.judged(p, 4)) == 'DOES NOT FIT in 4.00 GiB per device'
  usable = {**p, 'usable_bytes': 4 * gib}
  assert plan.judged(usable, 6)['fits'] is False  # The usable memory is.
  assert plan.verdict(plan.judged(usable, 6)) == (
      "DOES NOT FIT in 4.00 GiB per device (the TPU compiler's usable HBM)")
  assert plan.judged({**p, 'usable_bytes': None})['fits'] is None


def test_collectives_follow_the_rules(devices):
  """Standard rules: activations all-reduced over 'model' (Megatron), gradients over
  'batch', nothing gathered. FSDP: parameters all-gathered over 'batch'."""
  del devices
  standard = plan.make_plan(load_config('char_lm', **{'mesh.shape': (4, 2)}))
  kinds = {(r['kind'], r['axes']) for r in standard['collectives']}
  assert {('all-reduce', 'model'), ('all-reduce', 'batch')} <= kinds
  assert not any(kind == 'all-gather' for kind, _ in kinds), kinds
  fsdp = plan.make_plan(load_config('char_lm', 'smoke,fsdp', **{'mesh.shape': (4, 2)}))
  assert ('all-gather', 'batch') in {(r['kind'], r['axes']) for r in fsdp['collectives']}
  assert fsdp['bytes_per_device']['params'] < standard['bytes_per_device']['params'] / 3


HLO = '''
  %a = f32[4,32]{1,0} all-reduce(%x), channel_id=1, replica_groups=[4,2]<=[8], to_apply=%add
  %b = (f32[64]{0}, bf16[2,8]{1,0}) all-reduce(%y, %z), replica_groups={{0,2,4,6},{1,3,5,7}}, to_apply=%add
  %c = f32[8,16]{1,0} all-gather(%w), replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, dimensions={0}
  %d = (f32[2]{0}, f32[8]{0}) all-gather-start(%v), replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}
  %g = ((f32[2]{0}, f8e4m3fn[4]{0}), (f32[8]{0}, f8e4m3fn[16]{0})) all-gather-start(%p, %q), replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}
  %h = (bf16[2,8]{1,0}, /*index=1*/bf16[8,8]{1,0}) all-gather-start(%o), replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}
  %i = f32[16]{0} fusion(%all-reduce.1), metadata={op_name="x all-gather(y)"}
  %e = f32[16]{0} collective-permute(%u), source_target_pairs={{0,1},{1,0}}
  %f = f32[16]{0} add(%all-reduce, %u)
'''


def test_collectives_parser_reads_every_replica_group_form():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ('batch', 'model'))
  rows = {(r['kind'], r['axes']): (r['count'], r['bytes'], r['group_size'])
          for r in hlo.collectives(HLO, mesh)}
  assert rows == {
      ('all-reduce', 'model'): (1, 4 * 32 * 4, 2),
      ('all-reduce', 'batch'): (1, 64 * 4 + 16 * 2, 4),
      # device_ids lists the mesh column-major: axis_0's groups are then {0, 1, 2, 3}...
      ('all-gather', 'part of batch+model'): (1, 8 * 16 * 4, 4),
      # The starts' results, not their operands: one array, a combined pair, a matrix.
      ('all-gather', 'batch'): (3, 8 * 4 + 8 * 4 + 16 * 1 + 8 * 8 * 2, 4),
      ('collective-permute', 'pairs'): (1, 16 * 4, None)}


def test_dry_run_plans_a_mesh_larger_than_the_tests_and_writes_nothing(tmp_path):
  """16 emulated devices on a (4, 4) mesh; a memory budget it misses; a --workdir it ignores."""
  workdir = tmp_path / 'run'
  args = [f'--config={experiment("char_lm")}:smoke', '--config.mesh.shape=(4,4)', '--dry_run',
          f'--workdir={workdir}']
  tight = run_cli(*args, '--device_memory_gib=0.001', devices=16)
  assert tight.returncode == 1, tight.stderr[-3000:]
  out = tight.stdout  # The whole plan, then the verdict.
  assert "mesh {'batch': 4, 'model': 4} on 16 cpu devices" in out
  assert 'block_0/mlp/wi' in out and 'peak = args + outputs - aliased + temporaries' in out
  assert 'all-reduce' in out and 'groups of 4 (model)' in out and 'LM analytic' in out
  assert 'DOES NOT FIT in 1.02 MiB per device' in out
  assert tight.stderr.strip().splitlines()[-1].startswith(
      'zoo: the train step needs 0.0'), tight.stderr[-500:]
  assert 'more than --device_memory_gib=0.001' in tight.stderr
  assert not workdir.exists()
  no_workdir = run_cli(f'--config={experiment("char_lm")}:smoke')
  assert no_workdir.returncode == 1
  assert no_workdir.stderr.strip().splitlines()[-1] == (
      'zoo: error: --workdir is required (or --dry_run, which writes nothing)')


def test_max_batch_bisects_the_verdict_and_steps_around_other_refusals(monkeypatch, devices):
  """A stand-in compiler: batches up to 53 per device fit, 54 and more run out of memory,
  and 16 and 51 are refused for another reason (as the TPU compiler's scoped-VMEM errors
  are, not monotonically). The search finds 53, takes neither odd batch for either side,
  and reports both."""
  del devices
  asked, vmem = [], 'RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom'

  def probe(setup, per_device):
    del setup
    asked.append(per_device)
    if per_device in (16, 51):
      return {'train': memory.Compiled(refusal=vmem)}
    if per_device > 53:
      return {'train': memory.Compiled(refusal='RESOURCE_EXHAUSTED: Ran out of memory on HBM',
                                     needed=2**40)}
    return {'train': memory.Compiled(memory={'peak': per_device * 2**20})}
  monkeypatch.setattr(plan, '_probe', probe)
  found = plan.max_batch(load_config('char_lm', **{'mesh.shape': (8, 1)}), device_memory_gib=1)
  assert found['batch_per_device'] == 53 and found['global_batch'] == 53 * 8
  assert found['peak'] == 53 * 2**20 and found['refused_at'] == 54
  assert found['other_refusals'] == {16: vmem, 51: vmem}
  assert len(asked) == len(set(asked)) == found['compiles'] < 14  # Doubling, then bisecting.
  monkeypatch.setattr(plan, '_probe',
                      lambda setup, b: {'train': memory.Compiled(memory={'peak': 2**30 * b})})
  assert plan.max_batch(load_config('char_lm', **{'mesh.shape': (8, 1)}),
                        device_memory_gib=2.5)['batch_per_device'] == 2  # Halving from 2.


def test_max_batch_finds_the_edge_of_the_compiled_verdict(devices):
  """Real compiles on the 8 CPU devices against a budget: the batch found fits, one more
  step of batch does not. (A budget whose edge lies a doubling past the config's 16 per
  device, about 22, so that the search compiles a few batches, not 18 up to 1,289.)"""
  del devices
  budget = 0.000173  # GiB.
  config = load_config('mlp_digits', **{'mesh.shape': (8, 1)})
  found = plan.max_batch(config, device_memory_gib=budget)
  b = found['batch_per_device']
  assert b >= 8 and found['peak'] <= budget * 2**30, found
  for per_device, fits in ((b, True), (b + 1, False)):
    config.train.batch_size = per_device * 8
    assert plan.make_plan(config, budget)['fits'] is fits, per_device
