"""The logical-axis vocabulary, its default rules, the device mesh and the parameter table.

Model code names every parameter and activation axis with a *logical* name from
`LOGICAL_AXES`; `config.logical_axis_rules` maps each logical name to a mesh axis
(or None: replicated). Activation names carry an `act_` prefix so that no name is
both a parameter axis and an activation axis, and no logical name equals a mesh
axis name: the rule table is never ambiguous.
"""
import contextlib
import math
from typing import Any, Iterator, Sequence

import flax.linen as nn
import jax
import numpy as np

MESH_AXES = ('batch', 'model')
# Mesh axes that mesh.axes may add: rules naming one are left out on a mesh without it.
# 'context' splits sequences (context parallelism, `context_rules`); 'expert' the routed
# experts (`expert_rules`).
OPTIONAL_MESH_AXES = ('expert', 'context')

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
    'lora': (None, 'rank of a LoRA adapter (zoo.models.lora; small, so replicated)'),
    'experts': (None, 'routed experts of a mixture of experts (zoo.models.moe; expert_rules '
                'splits them over an expert mesh axis)'),
    'expert_embed': (None, "model width in the routed experts' weights (FSDP splits it "
                     "like 'embed')"),
    # Activations.
    'act_batch': ('batch', 'examples of the global batch (data parallel)'),
    'act_len': (None, "sequence positions (context_rules: split over 'context')"),
    'act_kv_len': (None, "keys' and values' positions in attention: gathered whole where the "
                   "queries' are split (context parallelism)"),
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


def standard_rules() -> tuple:
  """The default rules: (logical name, mesh axis or None) pairs, Flax's convention. Rules
  are tuples, so that config.logical_axis_rules is a field the command line can set
  (--config.logical_axis_rules="(('embed', 'batch'), ...)"; a list is not)."""
  return tuple((name, axis) for name, (axis, _) in LOGICAL_AXES.items())


def fsdp_rules() -> tuple:
  """Standard rules plus FSDP (ZeRO-3 style): parameters' 'embed' axis split over 'batch'.

  Every weight matrix touches 'embed', so parameter and optimizer bytes per device fall
  roughly as 1/(batch shards); each layer's weights are all-gathered as it runs, and
  their gradients reduce-scattered. Activations keep their own names and are unchanged.
  """
  return tuple((name, 'batch' if name in ('embed', 'expert_embed') else axis)
               for name, axis in standard_rules())


def expert_rules(rules: Sequence) -> tuple:
  """`rules` plus expert parallelism over a mesh axis 'expert', for a mesh.axes that has
  one (on a mesh without it these are `rules` again, see for_mesh): the routed experts
  split over it, and so does everything the rules split over 'batch' (the batch itself,
  FSDP's parameters), as MaxText's expert axis does. Flax takes the first rule whose mesh
  axes a parameter has not used yet: an expert weight's 'expert_embed' falls back to
  'batch' alone."""
  rules = rules_tuple(rules)
  wider = [(name, mesh_axes_of(axis) + ('expert',)) for name, axis in rules
           if 'batch' in mesh_axes_of(axis)]
  return (('experts', 'expert'), *wider, *rules)


def context_rules(rules: Sequence) -> tuple:
  """`rules` plus context parallelism over a mesh axis 'context' (MaxText's
  ici_context_parallelism): every activation's sequence ('act_len') split over it, the
  keys and values of attention gathered whole ('act_kv_len' stays unsplit), and every
  parameter axis that the rules split over 'batch' (FSDP's) split over 'context' too, so
  that the axis costs no state memory. The batch itself is not split over it: a global
  batch need only divide over 'batch'. `for_mesh` adds these on a mesh with a 'context'
  axis that no rule names."""
  rules = rules_tuple(rules)
  wider = [(name, mesh_axes_of(axis) + ('context',)) for name, axis in rules
           if not name.startswith('act_') and 'batch' in mesh_axes_of(axis)]
  return (('act_len', 'context'), *wider, *rules)


def names_axis(rules: Sequence, mesh_axis: str) -> bool:
  """Whether some rule maps a logical axis onto `mesh_axis`."""
  return any(mesh_axis in mesh_axes_of(axis) for _, axis in rules_tuple(rules))


def for_mesh(rules: Sequence, mesh_axes: Sequence[str]) -> tuple:
  """`rules` for a mesh with `mesh_axes`: those naming an optional mesh axis
  (OPTIONAL_MESH_AXES) that it lacks are left out; on a mesh with a 'context' axis that no
  rule names, `context_rules(rules)`."""
  rules = rules_tuple(rules)
  if 'context' in mesh_axes and not names_axis(rules, 'context'):
    rules = context_rules(rules)
  absent = set(OPTIONAL_MESH_AXES) - set(mesh_axes)
  return tuple((name, axis) for name, axis in rules
               if not absent & set(mesh_axes_of(axis)))


def shards(mesh: Any, rules: Sequence, logical: str) -> int:
  """How many blocks the rules split logical axis `logical` into on `mesh` (a Mesh or an
  AbstractMesh; Flax's first matching rule)."""
  axes = mesh_axes_of(nn.logical_to_mesh_axes((logical,), rules_tuple(rules))[0])
  return math.prod(dict(mesh.shape).get(a, 1) for a in axes)


def sequence_shards(mesh: Any, rules: Sequence) -> int:
  """How many blocks the rules split a sequence ('act_len') into: the context-parallel
  degree."""
  return shards(mesh, rules, 'act_len')


def sequence_mesh_axes(rules: Sequence) -> tuple:
  """The mesh axes that the rules map 'act_len' onto (Flax's first matching rule)."""
  return mesh_axes_of(nn.logical_to_mesh_axes(('act_len',), rules_tuple(rules))[0])


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


def batch_shards(mesh: jax.sharding.Mesh, rules: Sequence) -> int:
  """How many blocks the rules split a batch's rows into on `mesh`."""
  return math.prod(mesh.shape[a] for a in batch_mesh_axes(rules))


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
