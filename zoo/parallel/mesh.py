"""The device mesh: its shape, checked against the devices, and the order of the devices in it.

The devices go in the accelerator's physical order (`mesh_utils.create_device_mesh`, or
`create_hybrid_device_mesh` for several TPU slices), so that every group of devices along
a mesh axis is a block of neighbours on the chips' interconnect (ICI). Across processes
each process feeds the rows of the global batch that its devices hold, and the physical
order alone gives a host scattered rows (on a v5p-64, mesh (32, 1) gave process 0 rows
0-1, 8-9, 32-33 and 40-41 of 64: a pod run could not start). So the positions along the
'batch' axis are then sorted by the processes that hold them: every group of devices
stays the same set (the compiler routes the same collectives), and each process holds one
block of rows. Keeping whole hosts as blocks of the mesh instead (a host's chips on the
model axis) makes the batch groups strided lattices of chips, which the TPU compiler
cannot route on slices without wraparound (v5litepod-64 with a model axis of 4: "Failed
to create limited ICI routing replica info table").
"""
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
  dcn = one_slice(dcn_shape, len(axes))
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


def one_slice(dcn_shape: Optional[Sequence[int]], rank: int) -> tuple:
  """`dcn_shape`, where it says one slice (empty, or every entry 1, whatever its length:
  the default (1, 1) on a mesh with a third axis), as one 1 per axis."""
  dcn = tuple(dcn_shape or ())
  return (1,) * rank if all(d == 1 for d in dcn) else dcn


def resolve_mesh_shape(shape: Sequence[int], num_devices: int) -> tuple:
  """Fills the one -1 entry of `shape` so that its product is `num_devices`."""
  shape = tuple(int(s) for s in shape)
  if -1 in shape:
    known = math.prod(s for s in shape if s != -1)
    shape = tuple(num_devices // known if s == -1 else s for s in shape)
  return shape


def make_mesh(shape: Sequence[int], axes: Sequence[str], devices: Optional[Sequence] = None,
              dcn_shape: Sequence[int] = (), batch_axes: Sequence[str] = ('batch',)
              ) -> jax.sharding.Mesh:
  """A mesh over `devices` (default: all global devices) with Auto axis types, in physical
  order with each process's positions along `batch_axes` (the mesh axes the batch splits
  over, in the rules' order: with expert parallelism 'batch' and 'expert') together (see
  the module docstring).

  Linen's sharding annotations need Auto axes: jax.make_mesh defaults to Explicit, under
  which the embedding lookup fails to trace. `dcn_shape[i]` slices go along axis i; on
  machines without slices (CPU, GPU hosts) processes stand in for them.
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = resolve_mesh_shape(shape, len(devices))
  dcn = one_slice(dcn_shape, len(shape))
  axis_types = (jax.sharding.AxisType.Auto,) * len(axes)
  if len({d.process_index for d in devices}) == 1 and math.prod(dcn) == 1:
    return jax.make_mesh(shape, tuple(axes), devices=devices, axis_types=axis_types)
  slices = {getattr(d, 'slice_index', 0) for d in devices}
  # No slices (CPU, GPU hosts): processes stand in for them where dcn_shape asks for some.
  by_process = len(slices) == 1 and math.prod(dcn) > 1
  granules = len({d.process_index for d in devices}) if by_process else len(slices)
  if granules != math.prod(dcn):
    raise ConfigError(f'config.mesh.dcn_shape: {dcn} makes {math.prod(dcn)} slices but there '
                      f'are {granules} {"processes" if by_process else "slices"}; give slice '
                      f'counts whose product is {granules}, e.g. '
                      f'({granules}, {", ".join(["1"] * (len(dcn) - 1))}) to put them on batch')
  if granules == 1:
    layout = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
  else:
    ici = tuple(s // d for s, d in zip(shape, dcn))
    layout = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=by_process,
                                                  allow_split_physical_axes=True)
  batch = [list(axes).index(a) for a in batch_axes if a in axes] or [0]
  return jax.sharding.Mesh(batch_by_process(layout, batch), tuple(axes), axis_types=axis_types)


def batch_by_process(layout: np.ndarray, batch_axes: Sequence[int]) -> np.ndarray:
  """`layout` with its positions along `batch_axes` (taken together, row-major in that
  order, as a batch split over them is) sorted by the lowest process index (then device id)
  that each holds: along one axis the same groups of devices, each process's positions
  together wherever the layout allows it; along several, each process's rows together at
  the price of regrouping the devices along those axes."""
  lead = list(range(len(batch_axes)))
  moved = np.moveaxis(layout, batch_axes, lead)
  slabs = moved.reshape((-1,) + moved.shape[len(lead):])
  key = lambda i: (min(d.process_index for d in slabs[i].flat), min(d.id for d in slabs[i].flat))
  slabs = slabs[sorted(range(len(slabs)), key=key)]
  return np.moveaxis(slabs.reshape(moved.shape), lead, batch_axes)
