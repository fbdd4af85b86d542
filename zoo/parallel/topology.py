"""Compile-only devices of a target the run is planned for, on any host: a Cloud TPU pod
slice (or several), named as Cloud TPU names accelerator types, or NVIDIA GPU hosts.

JAX builds them without the hardware (`jax.experimental.topologies.get_topology_desc`):
each device has the real layout's `process_index` (and on TPU `coords`, `slice_index`),
and a program compiled for a mesh of them is compiled by the target's own compiler. On
TPU (libtpu, `.[tpu]`) the compiler's memory analysis and its out-of-memory refusal are
the authority on whether a run fits. On GPU (JAX's CUDA plugin, `.[cuda12]`) the compiler
warns and goes on past the memory, so zoo's own sum decides. Nothing can run on these
devices: build every constant before entering their mesh.

TPU names: `v4-N` and `v5p-N` count TensorCores (two per chip, run as one megacore
device: v5p-64 = 32 chips = `v5p:2x4x4`); `v5litepod-N` (or `v5e-N`) and `v6e-N` count
chips (one core each; up to 8 chips are one host, larger slices have 4 per host); `tpu7x-N`
counts TensorCores (two per chip, each a device). libtpu's own `GEN:AxB[xC]` names any
other shape. GPU names: `h100-N` and `a100-N` (80 GB, SXM), N GPUs, 8 per host.
"""
import dataclasses
import importlib.util
import math
import os
import re
from typing import Optional

import numpy as np

from zoo.errors import ConfigError

# user-facing name -> (libtpu's name, axes of the torus, whether N counts cores).
GENERATIONS = {
    'v4': ('v4', 3, True),
    'v5p': ('v5p', 3, True),
    'v5litepod': ('v5e', 2, False),
    'v5e': ('v5e', 2, False),
    'v6e': ('v6e', 2, False),
    'tpu7x': ('tpu7x', 3, True),
}
# Chips -> the slice's shape, as Cloud TPU deploys them (other shapes: GEN:AxBxC).
SHAPES = {
    2: {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16),
        256: (16, 16)},
    3: {1: (1, 1, 1), 4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4),
        128: (4, 4, 8), 256: (4, 8, 8), 512: (8, 8, 8), 1024: (8, 8, 16), 2048: (8, 16, 16),
        4096: (16, 16, 16)},
}
# The GPU compiler's description of a device: NVIDIA's published properties (CUDA's
# cudaDeviceProp) of the 80 GB SXM parts, in XLA's GpuTargetConfigProto fields.
GPUS = {
    'h100': dict(name='NVIDIA H100 80GB HBM3', major=9, cores=132, memory=84942979072,
                 bandwidth=3352320000000, l2=52428800, clock=1.98, shared_per_core=233472,
                 shared_optin=232448),
    'a100': dict(name='NVIDIA A100-SXM4-80GB', major=8, cores=108, memory=85198045184,
                 bandwidth=2039000000000, l2=41943040, clock=1.41, shared_per_core=167936,
                 shared_optin=166912),
}
GPUS_PER_HOST = 8
DEFAULT_MEM_FRACTION = 0.75  # Of a GPU's memory, what JAX's allocator takes by default.
_PROBE_BYTES = 2**40  # More than any chip has: the compiler's refusal names its usable HBM.


@dataclasses.dataclass(frozen=True)
class Target:
  """A TPU slice (or `num_slices` of them), or GPU hosts."""
  name: str              # As given, e.g. 'v5p-64' or 'h100-16'.
  platform: str          # 'tpu' or 'cuda'.
  generation: str        # libtpu's ('v5p') or the GPU's ('h100').
  shape: tuple           # TPU: chips along each torus axis; GPU: (hosts, GPUs per host).
  num_slices: int = 1

  @property
  def chips(self) -> int:
    return math.prod(self.shape)

  @property
  def topology(self) -> str:
    if self.platform == 'cuda':
      return f'1x{self.shape[0]}x{self.shape[1]}'
    return f'{self.generation}:{"x".join(map(str, self.shape))}'

  def options(self) -> dict:
    """get_topology_desc's keyword arguments for this target."""
    if self.platform == 'cuda':
      return {'target_config': gpu_target_config(self.generation)}
    options = {'num_slices': self.num_slices}
    if self.generation in ('v4', 'v5p'):
      options['chip_config_name'] = 'megacore'  # Both cores of a chip as one device.
    if len(self.shape) == 2:  # v5e and v6e: single-host slices hold all their chips.
      options['chips_per_host_bounds'] = ((2, 4, 1) if self.chips == 8 else
                                          (1, 1, 1) if self.chips == 1 else (2, 2, 1))
    elif self.chips == 1:
      options['chips_per_host_bounds'] = (1, 1, 1)
    return options


def gpu_target_config(gpu: str) -> str:
  """The GpuTargetConfigProto text of `gpu` (a key of GPUS) that the CUDA plugin compiles
  for without a GPU."""
  g = GPUS[gpu]
  return (f'gpu_device_info {{\n  threads_per_block_limit: 1024\n  threads_per_warp: 32\n'
          f'  shared_memory_per_block: 49152\n  shared_memory_per_core: {g["shared_per_core"]}\n'
          f'  threads_per_core_limit: 2048\n  core_count: {g["cores"]}\n  fpus_per_core: 128\n'
          f'  block_dim_limit_x: 2147483647\n  block_dim_limit_y: 65535\n'
          f'  block_dim_limit_z: 65535\n  memory_bandwidth: {g["bandwidth"]}\n'
          f'  l2_cache_size: {g["l2"]}\n  clock_rate_ghz: {g["clock"]}\n'
          f'  device_memory_size: {g["memory"]}\n'
          f'  shared_memory_per_block_optin: {g["shared_optin"]}\n'
          f'  cuda_compute_capability {{ major: {g["major"]} }}\n'
          f'  registers_per_core_limit: 65536\n  registers_per_block_limit: 65536\n}}\n'
          f'platform_name: "CUDA"\ndnn_version_info {{ major: 9 minor: 10 }}\n'
          f'device_description_str: "{g["name"]}"\n')


MAX_SLICES = 1024  # Far beyond any multi-slice job run so far (tens of slices).


def parse(name: str, num_slices: int = 1, field: str = '--topology') -> Target:
  """A Target from a Cloud TPU accelerator type ('v5p-64', 'v5litepod-256', 'v6e-8'),
  libtpu's form ('v5p:2x4x4'), or GPUs ('h100-16'); ConfigError naming `field` otherwise."""
  known = ', '.join([f'{g}-N' for g in GENERATIONS] + [f'{g}-N' for g in GPUS])
  if not 1 <= num_slices <= MAX_SLICES:
    raise ConfigError(f'--num_slices: must be in [1, {MAX_SLICES}], got {num_slices}')
  if (m := re.fullmatch(r'([a-z0-9]+):(\d+(?:x\d+){1,2})', name)):
    generation, shape = m.group(1), tuple(int(s) for s in m.group(2).split('x'))
    libtpu = {g: v[0] for g, v in GENERATIONS.items()}.get(generation, generation)
    return Target(name, 'tpu', libtpu, shape, num_slices)
  m = re.fullmatch(r'([a-z0-9]+)-(\d+)', name)
  if m and m.group(1) in GPUS:
    count = int(m.group(2))
    if num_slices != 1 or count < 1 or (count > GPUS_PER_HOST and count % GPUS_PER_HOST):
      raise ConfigError(f'{field}: {name!r}: give up to {GPUS_PER_HOST} GPUs or a multiple of '
                        f'{GPUS_PER_HOST} (whole hosts), and no --num_slices')
    per_host = min(count, GPUS_PER_HOST)
    return Target(name, 'cuda', m.group(1), (count // per_host, per_host))
  if not m or m.group(1) not in GENERATIONS:
    raise ConfigError(f'{field}: {name!r} is not an accelerator type zoo compiles for; give one '
                      f"of {known} (e.g. v5p-64, v5litepod-256, h100-16), or libtpu's GEN:AxBxC "
                      '(e.g. v5p:2x4x4)')
  libtpu, axes, counts_cores = GENERATIONS[m.group(1)]
  count = int(m.group(2))
  shape = SHAPES[axes].get(count // 2 if counts_cores else count)
  if shape is None or (counts_cores and count % 2):
    sizes = ', '.join(f'{m.group(1)}-{c * 2 if counts_cores else c}' for c in SHAPES[axes])
    raise ConfigError(f'{field}: {name!r}: no {m.group(1)} slice of that size is known here '
                      f'({sizes}); give its shape as {libtpu}:' + 'x'.join('ABC'[:axes]))
  return Target(name, 'tpu', libtpu, shape, num_slices)


def _compile_only_libtpu() -> None:
  """libtpu asks for the first two on start-up when no TPU VM describes itself (their
  values do not change the topology it builds: set where unset, they keep its warnings
  away), and by default lets one process on a host load it (it guards the local TPU; a
  compile-only process touches none, so plans run beside a training job or each other)."""
  os.environ.setdefault('TPU_ACCELERATOR_TYPE', 'v5p-8')
  os.environ.setdefault('TPU_WORKER_HOSTNAMES', 'localhost')
  os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')


def devices(target: Target) -> list:
  """The target's compile-only devices; ConfigError without the compiler's package or
  for a shape it does not know."""
  package, extra = ('libtpu', 'tpu') if target.platform == 'tpu' else ('jax_cuda12_plugin',
                                                                         'cuda12')
  if importlib.util.find_spec(package) is None:
    raise ConfigError(f"--topology: compiling for {target.name} needs {package}: pip install -e "
                      f"'.[{extra}]' (it installs on any host; no accelerator is needed to "
                      'compile)')
  if target.platform == 'tpu':
    _compile_only_libtpu()
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  where = ({'topology_name': target.topology} if target.platform == 'tpu' else
           {'topology': target.topology})
  try:
    return list(topologies.get_topology_desc(platform=target.platform, **where,
                                             **target.options()).devices)
  except Exception as e:  # pylint: disable=broad-except  # The plugins raise their own types.
    raise ConfigError(f'--topology: cannot build {target.topology} for {target.platform} '
                      f'({str(e).splitlines()[0][:200]}); check the name and size') from None


def usable_memory(target: Target, device) -> tuple[int, str]:
  """(bytes per device a run may use, where that figure comes from). TPU: what its
  compiler lets a program use, read from its refusal of one that needs more. GPU: JAX's
  allocator's share of the device (XLA_PYTHON_CLIENT_MEM_FRACTION, default 0.75)."""
  if target.platform == 'cuda':
    fraction = float(os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION', DEFAULT_MEM_FRACTION))
    return (int(GPUS[target.generation]['memory'] * fraction),
            f'JAX\'s {fraction:g} of an {target.generation.upper()}\'s memory, '
            'XLA_PYTHON_CLIENT_MEM_FRACTION')
  import jax  # pylint: disable=import-outside-toplevel
  one = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array([device]), ('one',)),
                                   jax.sharding.PartitionSpec())
  try:
    jax.jit(lambda: jax.numpy.zeros((_PROBE_BYTES // 4,), np.float32),
            out_shardings=one).lower().compile()
  except Exception as e:  # pylint: disable=broad-except
    found = oom_figures(str(e))
    if found:
      return found[1], "the TPU compiler's usable HBM"
  raise ConfigError(f'--topology: the TPU compiler did not say how much HBM a {target.name} '
                    'device has; this libtpu is not one zoo knows')


def local_memory(device) -> Optional[tuple[int, str, Optional[int]]]:
  """(bytes JAX's allocator may use on this process's `device`, where that figure comes
  from, bytes in use now or None), from the runtime's memory statistics; None where the
  device has none (CPU)."""
  try:
    stats = device.memory_stats()
  except Exception:  # pylint: disable=broad-except  # Backends that do not implement it.
    stats = None
  if not stats or not stats.get('bytes_limit'):
    return None
  fraction = os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION')
  source = "its allocator's limit" + (f', XLA_PYTHON_CLIENT_MEM_FRACTION={fraction}' if fraction
                                      else '')
  return int(stats['bytes_limit']), source, stats.get('bytes_in_use')


_SIZE = r'([0-9.]+)([KMGT]?)'
UNITS = {'': 1, 'K': 2**10, 'M': 2**20, 'G': 2**30, 'T': 2**40}  # The compilers' G is GiB.


def oom_figures(message: str) -> Optional[tuple[int, int]]:
  """(bytes needed, usable bytes) from the TPU compiler's 'Ran out of memory on HBM'
  refusal ('... (18.54G) exceeds available HBM (15.75G)'; G is GiB); None otherwise."""
  m = re.search(r'Ran out of memory on HBM.*?\(' + _SIZE + r'\) exceeds available HBM \(' + _SIZE
                + r'\)', message, re.S)
  if not m:
    return None
  return (int(float(m.group(1)) * UNITS[m.group(2)]), int(float(m.group(3)) * UNITS[m.group(4)]))
