"""TPU pods without a TPU: compile-only devices from libtpu, the host layouts a pod run
starts with, and `--dry_run --topology` compiled by the TPU compiler itself."""
import importlib.util
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import REPO, cli_env, experiment, load_config
from zoo.data import feed
from zoo.errors import ConfigError
from zoo.parallel import mesh as mesh_lib
from zoo.parallel import topology
from zoo.run import setup as setup_lib

needs_libtpu = pytest.mark.skipif(not importlib.util.find_spec('libtpu'), reason="needs libtpu ('.[tpu]')")
needs_cuda = pytest.mark.skipif(not importlib.util.find_spec('jax_cuda12_plugin'),
                          reason="needs JAX's CUDA plugin ('.[cuda12]')")


@needs_libtpu
@pytest.mark.parametrize('name,libtpu,chips,processes,options', [
    ('v5p-64', 'v5p:2x4x4', 32, 8, {'chip_config_name': 'megacore'}),
    ('v5litepod-256', 'v5e:16x16', 256, 64, {'chips_per_host_bounds': (2, 2, 1)}),
    ('v5e-8', 'v5e:2x4', 8, 1, {'chips_per_host_bounds': (2, 4, 1)}),
    ('v6e-256', 'v6e:16x16', 256, 64, {'chips_per_host_bounds': (2, 2, 1)}),
    ('v4-32', 'v4:2x2x4', 16, 4, {'chip_config_name': 'megacore'}),
    ('tpu7x-8', 'tpu7x:2x2x1', 4, 1, {}),
    ('v5p:2x2x2', 'v5p:2x2x2', 8, 2, {'chip_config_name': 'megacore'}),
])
def test_accelerator_types_name_real_pod_layouts(name, libtpu, chips, processes, options):
  """Cloud TPU's names: v4/v5p count TensorCores (megacore chips), v5e/v6e count chips
  (8 on one host), tpu7x counts cores (two devices per chip)."""
  target = topology.parse(name)
  assert target.topology == libtpu and target.chips == chips
  assert options.items() <= target.options().items()
  devices = topology.devices(target)
  assert len(devices) == chips * (2 if name.startswith('tpu7x') else 1)
  assert len({d.process_index for d in devices}) == processes


@pytest.mark.parametrize('name,message', [
    ('v5p-63', r"--topology: 'v5p-63': no v5p slice of that size is known here \(v5p-2, "
               r'.*\); give its shape as v5p:AxBxC'),
    ('b200-8', r"--topology: 'b200-8' is not an accelerator type zoo compiles for; give one of "
               r'v4-N, .*h100-N, a100-N'),
    ('h100-12', r"--topology: 'h100-12': give up to 8 GPUs or a multiple of 8"),
    ('v5e-48', r"no v5litepod slice|no v5e slice of that size"),
])
def test_bad_names_get_one_line_with_the_fix(name, message):
  with pytest.raises(ConfigError, match=message):
    topology.parse(name)


def test_no_libtpu_names_the_extra(monkeypatch):
  import importlib.util  # pylint: disable=import-outside-toplevel
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, 'find_spec',
                      lambda name, *a: None if name == 'libtpu' else real(name, *a))
  with pytest.raises(ConfigError, match=r"--topology: compiling for v5p-8 needs libtpu: pip "
                                        r"install -e '\.\[tpu\]'"):
    topology.devices(topology.parse('v5p-8'))


def _rows(mesh, batch):
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('batch'))
  return feed.rows_by_process(sharding, batch)


@needs_libtpu
@pytest.mark.parametrize('name,slices,shape,dcn', [
    ('v5p-64', 1, (32, 1), (1, 1)),
    ('v5p-64', 1, (8, 4), (1, 1)),
    ('v5litepod-256', 1, (256, 1), (1, 1)),
    ('v5litepod-256', 1, (64, 4), (1, 1)),
    ('v5litepod-256', 2, (512, 1), (2, 1)),
    ('v4-32', 1, (16, 1), (1, 1)),
    ('v6e-256', 1, (256, 1), (1, 1)),
])
def test_every_process_feeds_one_block_of_rows(name, slices, shape, dcn):
  """On real host layouts a plain physical order gives a host rows 0-1, 8-9, 32-33, ...
  of (32, 1); zoo's mesh gives each process one block of rows, in process order, and keeps
  every model group a box of neighbouring chips (the physical order's)."""
  devices = topology.devices(topology.parse(name, slices))
  processes = sorted({d.process_index for d in devices})
  mesh = mesh_lib.make_mesh(shape, ('batch', 'model'), devices, dcn)
  batch = 4 * shape[0]
  rows = _rows(mesh, batch)  # Raises ConfigError for a non-contiguous host.
  assert sorted(rows) == processes
  starts = [rows[p].start for p in processes]
  assert starts == sorted(starts) and rows[processes[-1]].stop == batch
  for row in mesh.devices:  # Each model group: chips filling a box of the torus.
    coords = np.array([d.coords for d in row])
    box = np.prod(coords.max(0) - coords.min(0) + 1)
    assert box * (2 if name.startswith('tpu7x') else 1) == len(row), coords
  if slices > 1:  # Slices along 'batch': the first half of the rows is slice 0's.
    assert {d.slice_index for d in mesh.devices[:shape[0] // 2].flat} == {0}


@needs_libtpu
def test_a_plain_physical_order_would_not_start():
  """What the mesh fixes: jax.make_mesh over a v5p-64's devices splits hosts' rows."""
  devices = topology.devices(topology.parse('v5p-64'))
  plain = jax.make_mesh((32, 1), ('batch', 'model'), devices=devices,
                        axis_types=(jax.sharding.AxisType.Auto,) * 2)
  with pytest.raises(ConfigError, match=r'process \d+ holds non-contiguous rows of the batch'):
    _rows(plain, 64)


@needs_libtpu
@pytest.mark.parametrize('shape', [(16, 4), (32, 2)])
def test_tensor_parallel_meshes_compile_on_a_slice_without_wraparound(shape):
  """v5litepod-64 (8x8 chips, no wraparound): with whole hosts as blocks of the mesh the
  batch groups are strided lattices the TPU compiler cannot route ("Failed to create
  limited ICI routing replica info table"); zoo's mesh compiles."""
  target = topology.parse('v5litepod-64')
  config = load_config('char_lm', **{'mesh.shape': shape, 'train.batch_size': 2 * shape[0],
                                     'eval.batch_size': shape[0]})
  s = setup_lib.checked(config, topology.devices(target), plan=True)
  # One block of rows each (two hosts that share a model group feed the same rows).
  rows = feed.rows_by_process(s.batch_sharding, 2 * shape[0])
  assert len(rows) == 16 and max(r.stop for r in rows.values()) == 2 * shape[0]
  with s.scope():
    s.jit_train_step().lower(s.abstract_state(), s.batch).compile()


@needs_libtpu
def test_oom_figures_read_the_compilers_refusal():
  message = ('RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO '
             'temporaries (18.54G) exceeds available HBM (15.75G).')
  assert topology.oom_figures(message) == (int(18.54 * 2**30), int(15.75 * 2**30))
  assert topology.oom_figures('RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom') is None
  target = topology.parse('v5litepod-4')
  assert topology.usable_memory(target, topology.devices(target)[0]) == (
      int(15.75 * 2**30), "the TPU compiler's usable HBM")


def _dry_run(*args, timeout=300):
  """zoo.main --dry_run in a fresh process, as a user runs it: no JAX_PLATFORMS, no TPU_*."""
  env = {k: v for k, v in os.environ.items()
         if k not in ('XLA_FLAGS', 'JAX_PLATFORMS', 'TPU_ACCELERATOR_TYPE', 'TPU_WORKER_HOSTNAMES')}
  return subprocess.run([sys.executable, '-m', 'zoo.main', '--dry_run', *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=timeout, check=False)


@needs_libtpu
def test_dry_run_compiles_for_a_pod_and_shows_its_hosts():
  """char_lm:smoke on v5p-16 (2 hosts x 4 chips) with the TPU compiler: the compiler's
  peak, the usable HBM, the verdict, each host's rows; nothing from libtpu on the console."""
  result = _dry_run(f'--config={experiment("char_lm")}:smoke', '--topology=v5p-16')
  assert result.returncode == 0, result.stderr[-3000:]
  out = result.stdout
  assert "mesh {'batch': 8, 'model': 1} on 8 tpu devices (TPU v5, v5p-16)" in out
  assert 'hosts: 2 processes x 4 devices; rows of the global batch each feeds: 0: 0-7, 1: 8-15' in out
  assert re.search(r'peak, by the compiler: [0-9.]+ MiB', out)
  assert re.search(r'compiled eval step, per device: peak [0-9.]+ MiB', out)
  assert 'fits in 95.74 GiB per device (the TPU compiler\'s usable HBM)' in out
  assert 'TPU_ACCELERATOR_TYPE' not in result.stderr and 'libtpu' not in result.stderr


# A step the TPU compiler refuses (its verdict, figures and exit): launch_test's
# test_tpu_pod_refuses_a_run_the_slice_cannot_fit_before_touching_a_vm, through the launcher.


@needs_libtpu
def test_multi_slice_plans_list_the_cross_slice_transfers():
  result = _dry_run(f'--config={experiment("char_lm")}:smoke', '--topology=v5litepod-8',
                    '--num_slices=2', '--config.mesh.dcn_shape=(2,1)')
  assert result.returncode == 0, result.stderr[-3000:]
  assert re.search(r'dcn all-reduce +\d+ x, across slices', result.stdout), result.stdout[-2000:]
  assert 'hosts: 2 processes x 8 devices' in result.stdout


@needs_libtpu
@pytest.mark.parametrize('args,message', [
    (['--topology=v5p-64'], None),  # Without --dry_run.
    (['--dry_run', '--topology=v5p-7'], r"--topology: 'v5p-7'"),
    (['--dry_run', '--topology=v5p-16', '--num_slices=2'],
     r'config\.mesh\.dcn_shape: \(1, 1\) makes 1 slices but there are 2 slices'),
])
def test_bad_topology_flags_are_one_line(args, message):
  env = cli_env()
  result = subprocess.run([sys.executable, '-m', 'zoo.main', f'--config={experiment("char_lm")}:smoke',
                           *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
                          check=False)
  assert result.returncode == 1 and 'Traceback' not in result.stderr
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith('zoo: error: ' + ('--topology and --max_batch go with --dry_run'
                                           if message is None else '')), last
  if message:
    assert re.search(message, last), last


@needs_cuda
def test_gpu_hosts_compile_without_a_gpu():
  """h100-16: two hosts of 8 H100s from zoo's own target description; the GPU compiler
  compiles the steps, zoo's peak sum decides against JAX's 75% of 80 GB."""
  target = topology.parse('h100-16')
  assert target.topology == '1x2x8'
  result = _dry_run(f'--config={experiment("char_lm")}:smoke', '--topology=h100-16')
  assert result.returncode == 0, result.stderr[-3000:]
  out = result.stdout
  assert "on 16 gpu devices (NVIDIA H100 80GB HBM3, h100-16)" in out
  assert 'hosts: 2 processes x 8 devices; rows of the global batch each feeds: 0: 0-7, 1: 8-15' in out
  assert 'peak = args + outputs - aliased + temporaries + code' in out
  assert re.search(r"fits in 59\.33 GiB per device \(JAX's 0\.75 of an H100's memory", out), out[-2000:]
  too_big = _dry_run(f'--config={experiment("char_lm")}:1b', '--topology=a100-8',
                     '--config.mesh.shape=(8,1)', '--config.train.batch_size=512')
  assert too_big.returncode == 1, too_big.stderr[-3000:]
  assert re.fullmatch(r'zoo: the train step needs [0-9.]+ GiB per device, more than the 59\.51 GiB '
                      r"per device that a100-8 allows \(JAX's 0\.75 of an A100's memory, "
                      r'XLA_PYTHON_CLIENT_MEM_FRACTION\); shard more .*',
                      too_big.stderr.strip().splitlines()[-1])
  assert 'splash' not in too_big.stderr.strip().splitlines()[-1]  # A TPU kernel.
