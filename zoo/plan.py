"""A run's plan without running it: `python -m zoo.main --config=... --dry_run`.

Builds the mesh and the abstract train state (no array is allocated), compiles the train
step for it and reports what each device would hold and do: the parameter sharding table;
bytes per device of parameters, optimizer state, model state and the batch; XLA's memory
analysis of the compiled step (arguments, outputs, donated buffers, temporaries) and
whether its peak fits `--device_memory_gib`; FLOPs per step; the collectives in the
compiled step. Emulated CPU devices (`--cpu_devices=N`) plan a mesh larger than the
machine: byte counts of state and batch are exact for any backend; temporaries and
collectives are what the CPU compiler chose, and another backend's fusion and
scheduling differ.
"""
import itertools
import math
import re
import time

import jax
import ml_collections
import numpy as np

from zoo import config as cfg
from zoo import perf, sharding, steps
from zoo import setup as setup_lib
from zoo.errors import ConfigError

COLLECTIVES = ('all-reduce', 'all-gather', 'reduce-scatter', 'all-to-all', 'collective-permute')
_OP = re.compile(r'=\s+([^%"=]*?)\s+(' + '|'.join(COLLECTIVES) + r')(-start)?\(')
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
  the results' per device. An op inside a loop body (nn.scan, microbatches) is listed once."""
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
  return sorted(rows.values(), key=lambda r: (r['kind'], r['group_size'] or 0))


def make_plan(config: ml_collections.ConfigDict, device_memory_gib: float = 0.0) -> dict:
  """The plan of `config` on the present devices, as a dict (see format_plan)."""
  cfg.validate(config, jax.device_count())
  setup = setup_lib.checked(config)
  with setup.scope():
    state = setup.abstract_state()
    t0 = time.perf_counter()
    compiled = steps.jit_train_step(setup).lower(state, setup.batch).compile()
    compile_s = time.perf_counter() - t0
  held = {'params': sharding.per_device_bytes(state.params),
          'optimizer': sharding.per_device_bytes(state.opt_state),
          'model_state': sharding.per_device_bytes(state.model_state),
          'batch': sharding.per_device_bytes(setup.batch)}
  held['other'] = sharding.per_device_bytes(state) - held['params'] - held['optimizer'] - \
      held['model_state']  # The step counter.
  m = compiled.memory_analysis()
  memory = None
  if m is not None:
    memory = {'arguments': m.argument_size_in_bytes, 'outputs': m.output_size_in_bytes,
              'aliased': m.alias_size_in_bytes, 'temporaries': m.temp_size_in_bytes,
              'code': m.generated_code_size_in_bytes}
    # Donated state: outputs that alias arguments take no extra memory.
    memory['peak'] = (memory['arguments'] + memory['outputs'] - memory['aliased']
                      + memory['temporaries'] + memory['code'])
  budget = device_memory_gib * 2**30 if device_memory_gib else None
  if budget and memory is None:
    raise ConfigError('--device_memory_gib: this backend gives no memory analysis of the '
                      'compiled step, so the budget cannot be checked; drop the flag')
  return {
      'mesh': dict(setup.mesh.shape), 'devices': setup.mesh.size,
      'platform': setup.mesh.devices.flat[0].platform,
      'params': setup.param_table(), 'bytes_per_device': held, 'compiled_memory': memory,
      'device_memory_bytes': budget,
      'fits': None if budget is None or memory is None else memory['peak'] <= budget,
      'step_cost': perf.step_cost(setup, state, compiled),
      'compile_s': compile_s,
      'collectives': collectives(compiled.as_text(), setup.mesh),
  }


def _mib(n):
  return f'{n / 2**20:,.2f} MiB'


def format_plan(p: dict) -> str:
  """The plan as text."""
  lines = [f'mesh {p["mesh"]} on {p["devices"]} {p["platform"]} devices; the train step '
           f'compiled in {p["compile_s"]:.1f} s', '', sharding.format_param_table(p['params']), '',
           'per device:']
  held = p['bytes_per_device']
  for key, label in (('params', 'parameters'), ('optimizer', 'optimizer state'),
                     ('model_state', 'model state (BatchNorm)'), ('batch', 'train batch'),
                     ('other', 'step counter')):
    if held[key]:
      lines.append(f'  {label:32s}{_mib(held[key]):>14s}')
  m = p['compiled_memory']
  if m is None:
    lines.append('  (this backend gives no memory analysis of the compiled step)')
  else:
    lines.append('compiled train step, per device (XLA memory analysis):')
    for key, label in (('arguments', 'arguments (state + batch)'),
                       ('outputs', 'outputs (new state + metrics)'),
                       ('aliased', 'outputs aliasing donated args'),
                       ('temporaries', 'temporaries'), ('code', 'generated code'),
                       ('peak', 'peak = args + outputs - aliased + temporaries + code')):
      lines.append(f'  {label:32s}{_mib(m[key]):>14s}' if key != 'peak' else
                   f'  {label}: {_mib(m[key])}')
    lines.append('  (not counted: prefetched batches, the eval step, the runtime\'s own reserve)')
  if p['fits'] is not None:
    verdict = 'fits' if p['fits'] else 'DOES NOT FIT'
    lines.append(f'{verdict} in {_mib(p["device_memory_bytes"])} per device')
  lines.append(perf.format_cost(p['step_cost']))
  lines.append('collectives in the compiled step (an op in a loop body is listed once):')
  if not p['collectives']:
    lines.append('  none')
  for r in p['collectives']:
    group = f'groups of {r["group_size"]} ({r["axes"]})' if r['group_size'] else 'point to point'
    lines.append(f'  {r["kind"]:20s}{r["count"]:4d} x, {group:28s}'
                 f'{_mib(r["bytes"]):>14s} per device')
  return '\n'.join(lines)
