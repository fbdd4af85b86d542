"""Device memory: a run whose step runs out of device memory ends as one line (what was
asked, what the device has, what to change), exit 1, lease released, checkpoints as they
were; --dry_run on accelerators checks the plan against what their runtime lets JAX use."""
import os
import subprocess
import sys
import textwrap

import jax
import pytest

from conftest import REPO, cli_env, experiment, load_config
from zoo.parallel import topology
from zoo.run import memory, plan

GPU_OOM = ('RESOURCE_EXHAUSTED: Out of memory while trying to allocate 54.12GiB with allocator '
           'GPU_0_bfc.')
# A run of char_lm:smoke whose 6th train step raises the GPU allocator's error (injected:
# this CPU has no device memory to exhaust), saving every 4 steps.
INJECTED = textwrap.dedent(f'''
    import runpy, sys
    import jax
    from zoo.run import train
    compile_steps = train.compile_steps

    def failing(setup, state):
      step, *rest = compile_steps(setup, state)
      calls = []

      def call(*args):
        calls.append(1)
        if len(calls) == 6:
          raise jax.errors.JaxRuntimeError({GPU_OOM!r})
        return step(*args)
      return (call, *rest)
    train.compile_steps = failing
    sys.argv = ['zoo.main'] + sys.argv[1:]
    runpy.run_module('zoo.main', run_name='__main__')
''')


def test_a_run_out_of_device_memory_is_one_line_and_loses_nothing(tmp_path):
  workdir = tmp_path / 'run'
  result = subprocess.run(
      [sys.executable, '-c', INJECTED, f'--config={experiment("char_lm")}:smoke',
       f'--workdir={workdir}', '--cpu_devices=2', '--config.checkpoint.every_steps=4',
       '--config.checkpoint.async_save=False', '--config.train.steps=12'],
      cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 1, result.stderr[-3000:]
  assert 'Traceback' not in result.stderr, result.stderr[-3000:]
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith('zoo: error: device out of memory: a step asked the allocator for '
                         '54.12GiB more; cpu reports no memory figures; shard more (mesh, rules: '
                         'fsdp_rules), or lower train.batch_size, or raise train.microbatches or '
                         'model.remat'), last
  assert last.endswith("`--dry_run` prints the step's peak per device before a run"), last
  assert sorted(os.listdir(workdir / 'checkpoints')) == ['4']  # Step 6 failed: 4 stays newest.
  assert not (workdir / 'lease.json').exists()


def test_the_line_names_what_an_accelerator_has(monkeypatch):
  monkeypatch.setattr(topology, 'local_memory', lambda d: (int(59.33 * 2**30),
                                                           "its allocator's limit", 5 * 2**30))
  line = memory.oom_line(jax.errors.JaxRuntimeError(GPU_OOM))
  assert ("a step asked the allocator for 54.12GiB more; cpu lets JAX use 59.33 GiB (its "
          "allocator's limit), 5.00 GiB of it in use; shard more") in line, line
  assert not memory.is_device_oom(jax.errors.JaxRuntimeError('INTERNAL: something else'))
  assert not memory.is_device_oom(MemoryError('host'))
  tpu = ('RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space '
         'hbm. Used 18.54G of 15.75G hbm. Exceeded hbm capacity by 2.79G.')
  assert memory.is_device_oom(jax.errors.JaxRuntimeError(tpu))
  assert 'the compiler found the step needs 18.54 GiB;' in memory.oom_line(
      jax.errors.JaxRuntimeError(tpu))
  vmem = ('RESOURCE_EXHAUSTED: Ran out of memory in memory space vmem while allocating on stack '
          'for %fusion = ...')  # A kernel's scoped VMEM: no batch or sharding advice fixes it.
  assert not memory.is_device_oom(jax.errors.JaxRuntimeError(vmem))


def test_a_plan_on_accelerators_is_checked_against_their_memory(devices, monkeypatch):
  """Without --device_memory_gib or --topology, the plan of a run on this machine's
  accelerators gives a verdict against what their runtime lets JAX use (faked here: CPU
  devices have no memory statistics)."""
  del devices
  config = load_config('char_lm', **{'mesh.shape': (4, 2)})
  assert plan.verdict(plan.make_plan(config)) == ''  # CPU: nothing to check against.
  monkeypatch.setattr(topology, 'local_memory', lambda d: (2**20, "its allocator's limit", 0))
  p = plan.make_plan(config)
  assert plan.verdict(p) == ("DOES NOT FIT in 1.00 MiB per device (JAX's on this cpu: its "
                             "allocator's limit)")
  line = plan.refusal_line(p)
  assert line.startswith('zoo: the train step needs ') and (
      "GiB per device, more than the 1.00 MiB per device that this cpu allows (JAX's on this cpu: "
      "its allocator's limit); shard more") in line, line
  monkeypatch.setattr(topology, 'local_memory', lambda d: (2**34, "its allocator's limit", 0))
  assert plan.verdict(plan.make_plan(config)).startswith('fits in 16.00 GiB per device')


@pytest.mark.parametrize('platform,hint', [('tpu', 'model.attention=splash'),
                                           ('gpu', "model.attention='auto'"), ('cpu', None)])
def test_advice_names_the_platforms_attention(platform, hint):
  text = memory.advice(platform)
  assert text.startswith('shard more (mesh, rules: fsdp_rules)')
  assert (hint in text) if hint else 'attention' not in text
