"""The logical-axis vocabulary, its default rules, the device mesh and the parameter table.

Model code names every parameter and activation axis with a *logical* name from
`LOGICAL_AXES`; `config.logical_axis_rules` maps each logical name to a mesh axis
(or None: replicated). Activation names carry an `act_` prefix so that no name is
both a parameter axis and an activation axis, and no logical name equals a mesh
axis name: the rule table is never ambiguous.
"""
import math

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
    'act_kv': (None, 'size of one attention head'),
    'act_vocab': ('model', 'logits over the vocabulary'),
    'act_classes': (None, 'logits over the classes'),
    'act_height': (None, 'image rows'),
    'act_width': (None, 'image columns'),
}


def standard_rules():
  """The default rules: a list of (logical name, mesh axis or None), Flax's convention."""
  return [(name, axis) for name, (axis, _) in LOGICAL_AXES.items()]


def fsdp_rules():
  """Standard rules plus FSDP (ZeRO-3 style): parameters' 'embed' axis split over 'batch'.

  Every weight matrix touches 'embed', so parameter and optimizer bytes per device fall
  roughly as 1/(batch shards); each layer's weights are all-gathered as it runs, and
  their gradients reduce-scattered. Activations keep their own names and are unchanged.
  """
  return [(name, 'batch' if name == 'embed' else axis) for name, axis in standard_rules()]


def per_device_bytes(tree):
  """Bytes of one device's shards of `tree`: jax.Arrays or ShapeDtypeStructs with shardings."""
  return sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
             for leaf in jax.tree.leaves(tree))


def resolve_mesh_shape(shape, num_devices):
  """Fills the one -1 entry of `shape` so that its product is `num_devices`."""
  shape = tuple(int(s) for s in shape)
  if -1 in shape:
    known = math.prod(s for s in shape if s != -1)
    shape = tuple(num_devices // known if s == -1 else s for s in shape)
  return shape


def make_mesh(shape, axes, devices=None, dcn_shape=()):
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


def logical_shardings(boxed_tree, mesh, rules):
  """NamedShardings for a tree whose leaves are nn.Partitioned boxes or arrays."""
  specs = nn.get_partition_spec(boxed_tree)
  return nn.logical_to_mesh_sharding(specs, mesh, rules)


def param_table(boxed_params, mesh, rules):
  """One row per parameter: path, shape, dtype, logical axes, PartitionSpec, shard shape."""
  rows = []
  flat = jax.tree_util.tree_flatten_with_path(
      boxed_params, is_leaf=lambda x: isinstance(x, nn.Partitioned))[0]
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


def mesh_axes_of(entry):
  """The mesh axes of one PartitionSpec entry (None, a name or a tuple of names), as a tuple."""
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _shard_size(dim, entry, mesh):
  """One device's share of a dimension; None where it does not divide evenly."""
  shards = math.prod(mesh.shape[a] for a in mesh_axes_of(entry))
  return None if dim % shards else dim // shards


def format_param_table(rows):
  """The parameter table as aligned text for the log."""
  header = ('path', 'shape', 'logical axes', 'PartitionSpec', 'shard')
  lines = [header] + [(r['path'], str(tuple(r['shape'])), str(tuple(r['logical_axes'])),
                       str(tuple(r['partition_spec'])), str(tuple(r['shard_shape'])))
                      for r in rows]
  widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
  total = sum(int(np.prod(r['shape'])) for r in rows)
  text = ['  '.join(c.ljust(w) for c, w in zip(line, widths)) for line in lines]
  return '\n'.join(text + [f'{len(rows)} parameter arrays, {total:,} parameters'])
