r"""Grouped matmuls of routed experts, timed on the machine at hand: what model.grouped_matmul
chooses between (zoo.models.moe).

    python benchmarks/moe_bench.py               # on a GPU or TPU: the issue's shapes
    python benchmarks/moe_bench.py --smoke       # tiny shapes, any machine (CPU: seconds)

One expert projection, forward and forward+backward (the rows' and the weights' gradients),
rows sorted into groups of random sizes around the even share, bf16 in and out:
- `ragged_dot`: jax.lax.ragged_dot (XLA's: on GPUs a dense masked dot over every group);
- `mosaic_gpu` (NVIDIA Hopper): JAX's Mosaic GPU ragged dot, the transposed kernel as the
  weights' gradient; `megablox` (TPU): Pallas's gmm / tgmm;
- `capacity`: GShard's fixed blocks at capacity factor 1.25, one batched matmul [G, C, D];
- `dense`: one matmul of the same useful FLOPs, the floor to compare with.
Shapes: Mixtral's (16,384 rows, 4,096 x 14,336, 8 experts) and Qwen3-30B-A3B's (65,536
rows, 2,048 x 768, 128 experts). Prints a table (ms; x the dense floor's time; and the
share of the dense floor's throughput, `*_of_dense`, which issue 56 wants at 50% or more for
Mixtral's forward+backward on a GPU) and writes JSON.

    python benchmarks/moe_bench.py --tune    # on an NVIDIA Hopper GPU: the Mosaic kernels' tiles

`--tune` times each of the three Mosaic GPU kernels zoo runs (the forward, the rows'
gradient, the weights' gradient; zoo.models.moe._MGPU) alone at Mixtral's shape over TILES,
prints the fastest tiles of each (what _MGPU should hold) and the forward+backward with them.
"""
import itertools
import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from zoo.models import moe  # pylint: disable=wrong-import-position

SHAPES = {'mixtral': (16384, 4096, 14336, 8), 'qwen3-30b-a3b': (65536, 2048, 768, 128)}
SMOKE = {'tiny': (512, 128, 256, 8)}


def _sizes(rows, groups, seed=0):
  """Random group sizes around rows / groups, summing to rows."""
  weights = np.random.default_rng(seed).uniform(0.5, 1.5, groups)
  sizes = np.floor(weights / weights.sum() * rows).astype(np.int32)
  sizes[0] += rows - sizes.sum()
  return jnp.asarray(sizes)


def _time(f, *args, repeats):
  jax.block_until_ready(f(*args))  # Compile and warm up.
  t0 = time.perf_counter()
  for _ in range(repeats):
    out = f(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / repeats * 1e3


def _methods(platform):
  return ['ragged_dot'] + (['mosaic_gpu'] if platform == 'gpu' else ['megablox']
                           if platform == 'tpu' else []) + ['capacity', 'dense']


def measure(name, shape, platform, repeats):
  rows, d, f, groups = shape
  keys = jax.random.split(jax.random.key(0), 2)
  x = jax.random.normal(keys[0], (rows, d), jnp.bfloat16)
  w = (jax.random.normal(keys[1], (groups, d, f), jnp.float32) / np.sqrt(d)).astype(jnp.bfloat16)
  sizes = _sizes(rows, groups)
  capacity = int(np.ceil(1.25 * rows / groups))
  out = []
  for method in _methods(platform):
    if method == 'dense':
      fwd = lambda x, w: x @ w[0]
    elif method == 'capacity':
      fwd = lambda x, w: jnp.einsum('GCD,GDF->GCF', jnp.pad(
          x, ((0, groups * capacity - rows), (0, 0))).reshape(groups, capacity, d), w)
    else:
      fwd = lambda x, w, m=method: moe.grouped_matmul(x, w, sizes, m, jnp.bfloat16)
    both = jax.grad(lambda x, w, f=fwd: jnp.sum(f(x, w).astype(jnp.float32)), argnums=(0, 1))
    row = {'shape': name, 'method': method, 'rows': rows, 'd': d, 'f': f, 'groups': groups}
    try:
      row['forward_ms'] = round(_time(jax.jit(fwd), x, w, repeats=repeats), 3)
      row['forward_backward_ms'] = round(_time(jax.jit(both), x, w, repeats=repeats), 3)
    except Exception as e:  # pylint: disable=broad-except  # Out of memory, say: a row.
      row['error'] = str(e).splitlines()[0][:160]
    out.append(row)
    print(json.dumps(row), flush=True)
  floor = next(r for r in out if r['method'] == 'dense')
  for r in out:
    for key in ('forward_ms', 'forward_backward_ms'):
      if key in r and key in floor:
        r[key.replace('_ms', '_x_dense')] = round(r[key] / floor[key], 2)
        r[key.replace('_ms', '_of_dense')] = round(floor[key] / r[key], 3)
  return out


# Candidate tiles (ragged_dot_mgpu's own tuning sweep, trimmed): block_k 64 throughout.
TILES = [dict(block_m=m, block_n=n, block_k=64, max_concurrent_steps=c, grid_block_n=g)
         for m, n, c, g in itertools.product((64, 128), (128, 256), (2, 4), (1, 2, 4))]


def tune(repeats):
  """The fastest tiles for each Mosaic GPU kernel at Mixtral's shape, and forward+backward
  with them against the dense floor."""
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu  # pylint: disable=import-outside-toplevel
  rows, d, f, groups = SHAPES['mixtral']
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (rows, d), jnp.bfloat16)
  w = (jax.random.normal(keys[1], (groups, d, f), jnp.float32) / np.sqrt(d)).astype(jnp.bfloat16)
  g = jax.random.normal(keys[2], (rows, f), jnp.bfloat16)
  sizes = _sizes(rows, groups)
  kernels = {
      'forward': (lambda t: lambda x, w: ragged_dot_mgpu.ragged_dot(x, w, group_sizes=sizes, **t),
                  (x, w), f),
      'rows_grad': (lambda t: lambda g, w: ragged_dot_mgpu.ragged_dot(
          g, w, group_sizes=sizes, transpose_rhs=True, **t), (g, w), d),
      'weights_grad': (lambda t: lambda x, g: transposed_ragged_dot_mgpu.transposed_ragged_dot(
          x, g, group_sizes=sizes, **t), (x, g), f)}
  best, rows_out = {}, []
  for name, (make, args, n) in kernels.items():
    for tiles in TILES:
      if n % (tiles['block_n'] * tiles['grid_block_n']):
        continue
      row = {'kernel': name, **tiles}
      try:
        row['ms'] = round(_time(jax.jit(make(tiles)), *args, repeats=repeats), 3)
      except Exception as e:  # pylint: disable=broad-except  # Shared memory, say: a row.
        row['error'] = str(e).splitlines()[0][:120]
      rows_out.append(row)
      print(json.dumps(row), flush=True)
      if 'ms' in row and row['ms'] < best.get(name, ({}, float('inf')))[1]:
        best[name] = (tiles, row['ms'])
  chosen = {k: v[0] for k, v in best.items()}
  before = moe._MGPU  # pylint: disable=protected-access
  moe._MGPU = {**before, **chosen}  # pylint: disable=protected-access
  try:
    tuned = measure('mixtral (tuned tiles)', SHAPES['mixtral'], 'gpu', repeats)
  finally:
    moe._MGPU = before  # pylint: disable=protected-access
  return {'best': {k: {'tiles': v[0], 'ms': v[1]} for k, v in best.items()}, 'sweep': rows_out,
          'tuned': tuned}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--smoke', action='store_true', help='tiny shapes (any machine)')
  parser.add_argument('--repeats', type=int, default=10)
  parser.add_argument('--json', default='moe_bench.json')
  parser.add_argument('--tune', action='store_true',
                      help="a GPU's Mosaic kernels: the fastest tiles of each (Mixtral's shape)")
  args = parser.parse_args()
  platform = jax.default_backend()
  device = jax.devices()[0].device_kind
  if args.tune and platform != 'gpu':
    sys.exit(f'moe_bench: --tune times the Mosaic GPU kernels: it needs an NVIDIA GPU, not '
             f'{platform}')
  out = {'device': device, 'jax': jax.__version__}
  if args.tune:
    out['tune'] = tune(args.repeats)
    rows = out['tune']['tuned']
  else:
    rows = []
    for name, shape in (SMOKE if args.smoke else SHAPES).items():
      rows += measure(name, shape, platform, args.repeats)
  out['rows'] = rows
  with open(args.json, 'w', encoding='utf-8') as f:
    json.dump(out, f, indent=2)
  import tables  # pylint: disable=import-outside-toplevel  # benchmarks/tables.py
  tables.print_rows(f'grouped matmuls on {device}', rows)
  if args.tune:
    print('\nfastest tiles (zoo.models.moe._MGPU):', json.dumps(
        {k: v['tiles'] for k, v in out['tune']['best'].items()}))


if __name__ == '__main__':
  main()
