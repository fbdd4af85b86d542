"""The device mesh: its shape, checked against the devices, and the order of the devices in it.

On one process a mesh is `jax.make_mesh`'s (the accelerator's physical layout). Across
processes each process feeds the rows of the global batch that its devices hold, so the
layout must give every process one contiguous block of mesh positions along the batch
axes; a plain physical order does not (on a v5p-64, mesh (32, 1) gave process 0 rows
0-2, 8-10, 32-34 and 40-42). `make_mesh` therefore builds the mesh in three levels:

- slices (multi-slice TPU, `dcn_shape[i]` of them along axis i; without slices,
  processes stand in for them where dcn_shape asks for several), laid out row-major;
- inside a slice, its processes (hosts), each one block of the slice's mesh, laid out
  row-major in process order (consecutive TPU hosts are neighbours in the torus);
- inside a process, its devices in `mesh_utils.create_device_mesh`'s physical order.

A host's block takes as much of the innermost axes (the model axis) as the host's devices
allow, so tensor parallelism stays inside a host where it fits and batch rows go to hosts.
"""
import collections
import math
from typing import Optional, Sequence

import jax
from jax.experimental import mesh_utils
import numpy as np

from zoo.errors import ConfigError


def parse_mesh_shape(text: str, axes: Sequence[str], num_devices: int,
                     field: str = '--mesh_shape') -> tuple:
  """A command line's mesh shape, '1,8' or '-1,1', checked against the devices present."""
  try:
    shape = tuple(int(s) for s in text.split(','))
  except ValueError:
    raise ConfigError(f'{field}: {text!r} is not comma-separated integers, e.g. '
                      f"'1,{num_devices}'") from None
  return check_mesh_shape(shape, axes, num_devices, field=field)


def check_mesh_shape(shape: Sequence[int], axes: Sequence[str], num_devices: int,
                     field: str = 'config.mesh.shape',
                     dcn_shape: Optional[Sequence[int]] = None) -> tuple:
  """The shape with its -1 filled in. ConfigError naming `field` unless it gives one size
  per axis, at most one -1, and a product that is (or, with -1, divides) `num_devices`;
  and naming config.mesh.axes or config.mesh.dcn_shape (if given) where those are wrong."""
  shape, axes = tuple(shape), tuple(axes)
  if len(shape) != len(axes):
    repeated = (' (repeating --config.mesh.shape concatenates the tuples)'
                if field == 'config.mesh.shape' else '')
    raise ConfigError(f'{field}: {shape} has {len(shape)} entries but mesh.axes {axes} has '
                      f'{len(axes)}; give one size per axis{repeated}')
  if 'batch' not in axes or len(set(axes)) != len(axes):
    raise ConfigError(f'config.mesh.axes: {axes} must name distinct axes including "batch"')
  if shape.count(-1) > 1:
    raise ConfigError(f'{field}: {shape} has more than one -1; at most one axis size can be '
                      'inferred')
  if any(s == 0 or s < -1 for s in shape):
    raise ConfigError(f'{field}: {shape} has a size that is neither positive nor -1')
  dcn = tuple(dcn_shape or (1,) * len(axes))
  if len(dcn) != len(axes) or any(d <= 0 for d in dcn):
    raise ConfigError(f'config.mesh.dcn_shape: {dcn} must give one positive number of slices '
                      f'per axis of {axes}')
  known = math.prod(s for s in shape if s != -1)
  if -1 in shape and num_devices % known:
    raise ConfigError(f'{field}: {shape}: {num_devices} devices do not divide by {known}; '
                      f'make the other sizes divide {num_devices}')
  if -1 not in shape and known != num_devices:
    raise ConfigError(f'{field}: {shape} needs {known} devices but {num_devices} are present; '
                      f'make the product {num_devices} or put -1 for one axis')
  resolved = resolve_mesh_shape(shape, num_devices)
  if any(s % d for s, d in zip(resolved, dcn)):
    raise ConfigError(f'config.mesh.dcn_shape: {dcn} does not divide the mesh shape {resolved}; '
                      'each axis size must be a multiple of its number of slices')
  return resolved


def resolve_mesh_shape(shape: Sequence[int], num_devices: int) -> tuple:
  """Fills the one -1 entry of `shape` so that its product is `num_devices`."""
  shape = tuple(int(s) for s in shape)
  if -1 in shape:
    known = math.prod(s for s in shape if s != -1)
    shape = tuple(num_devices // known if s == -1 else s for s in shape)
  return shape


def make_mesh(shape: Sequence[int], axes: Sequence[str], devices: Optional[Sequence] = None,
              dcn_shape: Sequence[int] = ()) -> jax.sharding.Mesh:
  """A mesh over `devices` (default: all global devices) with Auto axis types, each
  process's devices one block (see the module docstring).

  Linen's sharding annotations need Auto axes: jax.make_mesh defaults to Explicit, under
  which the embedding lookup fails to trace. `dcn_shape[i]` slices go along axis i.
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = resolve_mesh_shape(shape, len(devices))
  dcn = tuple(dcn_shape) or (1,) * len(shape)
  axis_types = (jax.sharding.AxisType.Auto,) * len(axes)
  if len({d.process_index for d in devices}) == 1 and math.prod(dcn) == 1:
    return jax.make_mesh(shape, tuple(axes), devices=devices, axis_types=axis_types)
  return jax.sharding.Mesh(device_layout(shape, dcn, devices), tuple(axes),
                           axis_types=axis_types)


def _groups(devices, key):
  grouped = collections.defaultdict(list)
  for d in devices:
    grouped[key(d)].append(d)
  return [grouped[k] for k in sorted(grouped)]


def host_block(shape: Sequence[int], devices_per_host: int) -> Optional[tuple]:
  """The block of `shape` one host's devices fill: the innermost axes first (as much of
  the model axis as the host holds), then outward; None if no block fits exactly."""
  block, left = [1] * len(shape), devices_per_host
  for i in reversed(range(len(shape))):
    block[i] = math.gcd(shape[i], left)
    left //= block[i]
  return tuple(block) if left == 1 else None


def device_layout(shape: Sequence[int], dcn: Sequence[int], devices: Sequence) -> np.ndarray:
  """The devices as an array of `shape`: slices, then processes, then devices (module
  docstring). ConfigError where processes or slices cannot each hold whole blocks."""
  slices = _groups(devices, lambda d: getattr(d, 'slice_index', 0))
  by_process = len(slices) == 1 and math.prod(dcn) > 1
  if by_process:  # No slices (CPU, GPU hosts): processes stand in for them.
    slices = _groups(devices, lambda d: d.process_index)
  if len(slices) != math.prod(dcn):
    raise ConfigError(f'config.mesh.dcn_shape: {tuple(dcn)} makes {math.prod(dcn)} slices but '
                      f'there are {len(slices)} {"processes" if by_process else "slices"}; give '
                      f'slice counts whose product is {len(slices)}, e.g. '
                      f'({len(slices)}, {", ".join(["1"] * (len(dcn) - 1))}) to put them on batch')
  ici = tuple(s // d for s, d in zip(shape, dcn))
  layout = np.empty(shape, dtype=object)
  for slice_index, slice_devices in enumerate(slices):
    hosts = _groups(slice_devices, lambda d: d.process_index)
    sizes = {len(h) for h in hosts}
    block = host_block(ici, sizes.pop()) if len(sizes) == 1 else None
    if block is None:
      raise ConfigError(
          f'config.mesh.shape: {tuple(shape)} cannot give each of the {len(hosts)} processes '
          f'({len(slice_devices) // len(hosts)} devices each) one block of rows; make the '
          'model axis (or the batch axis) a multiple or a divisor of the devices per process')
    grid = tuple(i // b for i, b in zip(ici, block))
    corner = np.array(np.unravel_index(slice_index, dcn)) * ici
    for host_index, host in enumerate(hosts):
      start = corner + np.array(np.unravel_index(host_index, grid)) * block
      where = tuple(slice(a, a + b) for a, b in zip(start, block))
      layout[where] = _physical(block, host)
  return layout


def _physical(block, devices):
  """One host's devices as an array of `block`, in the accelerator's physical order where
  mesh_utils knows it (ring orders on TPU), else by id."""
  try:
    return mesh_utils.create_device_mesh(block, devices, allow_split_physical_axes=True)
  except (ValueError, NotImplementedError, AssertionError):
    return np.array(sorted(devices, key=lambda d: d.id), dtype=object).reshape(block)
