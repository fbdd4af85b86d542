"""What a compiled program's HLO says about its communication (the collectives, with the
mesh axes their device groups span, and the cross-slice (DCN) transfers of a multi-slice
TPU program, which the TPU compiler emits as host transfers to its megascale runtime) and
its matmuls' operand types (the low-precision ones: model.quantization)."""
import collections
import itertools
import math
import re

import jax
import numpy as np

COLLECTIVES = ('all-reduce', 'all-gather', 'reduce-scatter', 'all-to-all', 'collective-permute')
_OP = re.compile(r'=\s+([^%"=]*?)\s+(' + '|'.join(COLLECTIVES) + r')(-start)?\(')
# A multi-slice TPU program's data-centre-network collective: a host transfer to the
# megascale runtime, e.g. send(...) ..._xla_megascale_transfer_type="ALL_REDUCE".
_DCN = re.compile(r'=\s+(.*?)\s+send\(.*_xla_megascale_transfer_type="([A-Z_]+)"')
_SHAPE = re.compile(r'\b([a-z][a-z0-9]*)\[([0-9,]*)\]')


def _itemsize(dtype):
  """Bytes per element of an HLO type: the first number in its name is its bits (f32,
  bf16, s4, f8e4m3fn, c64); pred is a byte."""
  bits = re.search(r'\d+', dtype)
  return int(bits.group()) / 8 if bits else 1


def _bytes(shape_text):
  """Total bytes of the arrays in an HLO shape: `f32[4,32]{1,0}` or a (nested) tuple."""
  return int(sum(_itemsize(dtype) * math.prod(int(d) for d in dims.split(',') if d)
                 for dtype, dims in _SHAPE.findall(shape_text)))


def _tuple_elements(shape_text):
  """The top-level elements of a tuple shape `(a, (b, c), d)`; [shape_text] if no tuple."""
  text = shape_text.strip()
  if not text.startswith('('):
    return [text]
  elements, depth, start = [], 0, 1
  for i, ch in enumerate(text):  # Commas inside [dims] and {layout} do not split.
    depth += {'(': 1, '[': 1, '{': 1, ')': -1, ']': -1, '}': -1}.get(ch, 0)
    if (ch == ',' and depth == 1) or (ch == ')' and depth == 0):
      elements.append(text[start:i])
      start = i + 1
  return elements


def _iota(dims, perm=None):
  """XLA's iota device list: arange reshaped to `dims`, transposed by `perm`."""
  ids = np.arange(math.prod(dims)).reshape(dims)
  return ids.transpose(perm) if perm else ids


def _ints(text):
  return [int(x) for x in text.split(',') if x]


def _replica_groups(line, num_devices):
  """The replica groups of a collective's HLO line, as sets of logical device ids (positions
  in the mesh's flattened device order); None for point-to-point ops."""
  if (m := re.search(r'replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?', line)):
    dims = _ints(m.group(1))
    ids = _iota(_ints(m.group(2)), m.group(3) and _ints(m.group(3)))
    return [set(g) for g in ids.reshape(-1, dims[-1]).tolist()]
  if (m := re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([0-9,]+)\]"
                     r"(?:T\(([0-9,]+)\))?\))?\s*\{([^}]*)\}", line)):
    names_sizes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
    names, sizes = [n for n, _ in names_sizes], [int(s) for _, s in names_sizes]
    ids = np.arange(math.prod(sizes)) if not m.group(2) else \
        _iota(_ints(m.group(2)), m.group(3) and _ints(m.group(3))).reshape(-1)
    grouped = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(4))]
    ids = np.moveaxis(ids.reshape(sizes), grouped, list(range(-len(grouped), 0)))
    size = math.prod(sizes[i] for i in grouped)
    return [set(g) for g in ids.reshape(-1, size).tolist()]
  if (m := re.search(r'replica_groups=\{(\{[0-9,{}]*\})\}', line)):
    return [set(_ints(g)) for g in re.findall(r'\{([0-9,]*)\}', m.group(1))]
  if 'replica_groups={}' in line:
    return [set(range(num_devices))]
  return None


def _mesh_axes_of(group, mesh):
  """The mesh axes whose devices form `group` (the group holding device 0): e.g. 'model',
  or 'part of batch' for a subgroup of an axis's devices."""
  positions = np.arange(mesh.size).reshape(mesh.devices.shape)
  names = list(mesh.axis_names)
  candidates = [axes for r in range(1, len(names) + 1) for axes in itertools.combinations(names, r)]
  def devices_along(axes):
    index = tuple(slice(None) if a in axes else 0 for a in names)
    return set(positions[index].reshape(-1).tolist())
  for axes in candidates:
    if devices_along(axes) == group:
      return '+'.join(axes)
  for axes in candidates:
    if group < devices_along(axes):
      return 'part of ' + '+'.join(axes)
  return '?'


def collectives(hlo_text: str, mesh: jax.sharding.Mesh) -> list[dict]:
  """Collectives of a compiled module: rows {kind, group_size, axes, count, bytes}; bytes are
  the results' per device (a cross-slice transfer's: the data sent). An op inside a loop
  body (nn.scan, microbatches) is listed once."""
  rows = {}
  for line in hlo_text.splitlines():
    line = re.sub(r'/\*.*?\*/', '', line)  # Long tuples carry /*index=5*/ comments.
    m = _OP.search(line)
    if not m:
      continue
    shape, kind, start = m.groups()
    # An async start's shape is (operands, results[, context]), except all-reduce's: results.
    parts = _tuple_elements(shape)
    nbytes = _bytes(parts[1] if start and kind != 'all-reduce' and len(parts) > 1 else shape)
    groups = _replica_groups(line, mesh.size)
    first = next((g for g in groups if 0 in g), groups[0]) if groups else None
    size = len(first) if first else None
    axes = _mesh_axes_of(first, mesh) if first else 'pairs'
    row = rows.setdefault((kind, size, axes), {
        'kind': kind, 'group_size': size, 'axes': axes, 'count': 0, 'bytes': 0})
    row['count'] += 1
    row['bytes'] += nbytes
  for line in hlo_text.splitlines():  # Cross-slice transfers: a send per transfer.
    m = _DCN.search(line)
    if m:
      row = rows.setdefault(('dcn', m.group(2)), {
          'kind': 'dcn ' + m.group(2).lower().replace('_', '-'), 'group_size': None,
          'axes': 'slices', 'count': 0, 'bytes': 0})
      row['count'] += 1
      row['bytes'] += _bytes(_tuple_elements(m.group(1))[0])
  return sorted(rows.values(), key=lambda r: (r['kind'], r['group_size'] or 0))


_DEFINED = re.compile(r'%([\w.\-]+) = (\w+)\[')   # An instruction and its element type.
_PARAMETER = re.compile(r'([\w.\-]+): (\w+)\[')    # A computation's parameter and its type.
_MATMUL = re.compile(r'\s(?:dot|convolution)\(%([\w.\-]+), %([\w.\-]+)\)')


def matmul_types(hlo_text: str) -> collections.Counter:
  """How many dots (and convolutions: the TPU compiler's dots) of a compiled module take
  each pair of operand element types, e.g. {('s8', 's8'): 36, ('bf16', 'bf16'): 6}."""
  types = dict(_DEFINED.findall(hlo_text))
  types.update(_PARAMETER.findall(hlo_text))
  return collections.Counter((types.get(a), types.get(b)) for a, b in _MATMUL.findall(hlo_text))
