"""The logical-axis vocabulary, its default rules, the device mesh and the parameter table.

Model code names every parameter and activation axis with a *logical* name from
`LOGICAL_AXES`; `config.logical_axis_rules` maps each logical name to a mesh axis
(or None: replicated). Activation names carry an `act_` prefix so that no name is
both a parameter axis and an activation axis, and no logical name equals a mesh
axis name: the rule table is never ambiguous.
"""
import contextlib
import math
from typing import Any, Iterator, Optional, Sequence

import flax.linen as nn
import jax
from jax.experimental import mesh_utils
import numpy as np

from zoo.errors import ConfigError

MESH_AXES = ('batch', 'model')

# logical name -> (default mesh axis, meaning). The one table of names zoo uses.
LOGICAL_AXES = {
    # Parameters.
    'embed': (None, 'model width (d_model); the input features of an MLP'),
    'mlp': ('model', 'hidden units of an MLP block (Megatron: split over model)'),
    'heads': ('model', 'attention heads (Megatron: split over model)'),
    'kv_heads': ('model', 'key/value heads of grouped-query attention (fewer than heads)'),
    'kv': (None, 'size of one attention head'),
    'vocab': ('model', 'vocabulary of a language model (padded to a multiple of 128)'),
    'classes': (None, 'output classes of a classifier (few, so replicated)'),
    'len': (None, 'positions of a learned position table'),
    'conv_height': (None, 'rows of a convolution kernel'),
    'conv_width': (None, 'columns of a convolution kernel'),
    'layers': (None, 'stacked layers of an nn.scan (model.scan_layers); replicated'),
    # Activations.
    'act_batch': ('batch', 'examples of the global batch (data parallel)'),
    'act_len': (None, 'sequence positions'),
    'act_embed': (None, 'model width'),
    'act_mlp': ('model', 'hidden units of an MLP block'),
    'act_heads': ('model', 'attention heads'),
    'act_kv_heads': ('model', 'key/value heads of grouped-query attention'),
    'act_kv': (None, 'size of one attention head'),
    'act_vocab': ('model', 'logits over the vocabulary'),
    'act_classes': (None, 'logits over the classes'),
    'act_height': (None, 'image rows'),
    'act_width': (None, 'image columns'),
}


def standard_rules() -> list[tuple]:
  """The default rules: a list of (logical name, mesh axis or None), Flax's convention."""
  return [(name, axis) for name, (axis, _) in LOGICAL_AXES.items()]


def fsdp_rules() -> list[tuple]:
  """Standard rules plus FSDP (ZeRO-3 style): parameters' 'embed' axis split over 'batch'.

  Every weight matrix touches 'embed', so parameter and optimizer bytes per device fall
  roughly as 1/(batch shards); each layer's weights are all-gathered as it runs, and
  their gradients reduce-scattered. Activations keep their own names and are unchanged.
  """
  return [(name, 'batch' if name == 'embed' else axis) for name, axis in standard_rules()]


def rules_tuple(rules: Sequence) -> tuple:
  """config.logical_axis_rules (lists once read back from JSON) as a tuple of pairs."""
  return tuple(tuple(rule) for rule in rules)


@contextlib.contextmanager
def scope(mesh: jax.sharding.Mesh, rules: Sequence) -> Iterator[None]:
  """The mesh and the logical-axis rules: trace model code under both, or its logical
  constraints silently do nothing."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    yield


def batch_mesh_axes(rules: Sequence) -> tuple:
  """The mesh axes that the rules map 'act_batch' onto (Flax's first matching rule)."""
  return mesh_axes_of(nn.logical_to_mesh_axes(('act_batch',), rules_tuple(rules))[0])


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


def fit_rules(logical_params: Any, mesh: jax.sharding.Mesh, rules: Sequence) -> tuple:
  """`rules`, with every logical axis that some parameter cannot split over `mesh` (its
  dimension does not divide) replicated instead: how a model whose sizes were chosen
  elsewhere (an imported one, a sample on another mesh) still goes on any mesh."""
  rules = rules_tuple(rules)
  while True:
    bad = {name for row in param_table(logical_params, mesh, rules)
           for name, shard in zip(row['logical_axes'], row['shard_shape']) if shard is None}
    if not bad:
      return rules
    rules = tuple((name, None if name in bad else axis) for name, axis in rules)


def per_device_bytes(tree: Any) -> int:
  """Bytes of one device's shards of `tree`: jax.Arrays or ShapeDtypeStructs with shardings."""
  return sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
             for leaf in jax.tree.leaves(tree))


def resolve_mesh_shape(shape: Sequence[int], num_devices: int) -> tuple:
  """Fills the one -1 entry of `shape` so that its product is `num_devices`."""
  shape = tuple(int(s) for s in shape)
  if -1 in shape:
    known = math.prod(s for s in shape if s != -1)
    shape = tuple(num_devices // known if s == -1 else s for s in shape)
  return shape


def make_mesh(shape: Sequence[int], axes: Sequence[str], devices: Optional[Sequence] = None,
              dcn_shape: Sequence[int] = ()) -> jax.sharding.Mesh:
  """A mesh over `devices` (default: all global devices) with Auto axis types.

  Linen's sharding annotations need Auto axes: jax.make_mesh defaults to
  Explicit, under which the embedding lookup fails to trace. A `dcn_shape` other than
  all ones builds a hybrid mesh for several TPU slices: `dcn_shape[i]` slices along axis
  i, each slice's devices contiguous inside it.
  """
  devices = jax.devices() if devices is None else devices
  shape = resolve_mesh_shape(shape, len(devices))
  axis_types = (jax.sharding.AxisType.Auto,) * len(axes)
  if math.prod(dcn_shape or (1,)) == 1:
    return jax.make_mesh(shape, tuple(axes), devices=devices, axis_types=axis_types)
  slices = {getattr(d, 'slice_index', 0) for d in devices}
  by_process = len(slices) == 1  # No slices (CPU, one GPU host): processes stand in for them.
  granules = len({d.process_index for d in devices}) if by_process else len(slices)
  if granules != math.prod(dcn_shape):
    raise ConfigError(f'config.mesh.dcn_shape: {tuple(dcn_shape)} makes {math.prod(dcn_shape)} '
                      f'slices but there are {granules} {"processes" if by_process else "slices"}')
  ici_shape = tuple(s // d for s, d in zip(shape, dcn_shape))
  array = mesh_utils.create_hybrid_device_mesh(ici_shape, tuple(dcn_shape), devices,
                                               process_is_granule=by_process)
  return jax.sharding.Mesh(array, tuple(axes), axis_types=axis_types)


def logical_shardings(logical_tree: Any, mesh: jax.sharding.Mesh, rules: Sequence) -> Any:
  """NamedShardings for a tree whose leaves are nn.Partitioned boxes or arrays."""
  specs = nn.get_partition_spec(logical_tree)
  return nn.logical_to_mesh_sharding(specs, mesh, rules)


def param_table(logical_params: Any, mesh: jax.sharding.Mesh, rules: Sequence) -> list[dict]:
  """One row per parameter: path, shape, dtype, logical axes, PartitionSpec, shard shape."""
  rows = []
  flat = jax.tree_util.tree_flatten_with_path(
      logical_params, is_leaf=lambda x: isinstance(x, nn.Partitioned))[0]
  for path, leaf in flat:
    value = leaf.value if isinstance(leaf, nn.Partitioned) else leaf
    names = tuple(leaf.names) if isinstance(leaf, nn.Partitioned) else (None,) * value.ndim
    spec = tuple(nn.logical_to_mesh_axes(names, rules)) + (None,) * (value.ndim - len(names))
    rows.append({
        'path': '/'.join(str(getattr(k, 'key', k)) for k in path),
        'shape': list(value.shape),
        'dtype': str(value.dtype),
        'logical_axes': list(names),
        'partition_spec': [list(e) if isinstance(e, tuple) else e for e in spec],
        'shard_shape': [_shard_size(dim, entry, mesh) for dim, entry in zip(value.shape, spec)],
    })
  return rows


def mesh_axes_of(entry: Any) -> tuple:
  """The mesh axes of one PartitionSpec entry (None, a name or a tuple of names), as a tuple."""
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _shard_size(dim, entry, mesh):
  """One device's share of a dimension; None where it does not divide evenly."""
  shards = math.prod(mesh.shape[a] for a in mesh_axes_of(entry))
  return None if dim % shards else dim // shards


def format_param_table(rows: list[dict]) -> str:
  """The parameter table as aligned text for the log."""
  header = ('path', 'shape', 'logical axes', 'PartitionSpec', 'shard')
  lines = [header] + [(r['path'], str(tuple(r['shape'])), str(tuple(r['logical_axes'])),
                       str(tuple(r['partition_spec'])), str(tuple(r['shard_shape'])))
                      for r in rows]
  widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
  total = sum(int(np.prod(r['shape'])) for r in rows)
  text = ['  '.join(c.ljust(w) for c, w in zip(line, widths)) for line in lines]
  return '\n'.join(text + [f'{len(rows)} parameter arrays, {total:,} parameters'])
