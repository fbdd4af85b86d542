r"""Checkpoint benchmark: zoo's save/restore against plain orbax and numpy. Not a test.

    python benchmarks/checkpoint_bench.py [--out=checkpoint_bench.json]

On 8 emulated CPU devices, for a ~100 MB train state (a transformer_lm with Adam) and the
experiments' states, it prints one table row per state (saves: best of --repeats; restores:
median, same and other mesh interleaved):
  blocked/total  time the loop waits in an async save / the save's total time (goal <= 25%)
  save vs orbax  zoo's save throughput / plain orbax StandardCheckpointer's (goal >= 0.8)
  save vs numpy  zoo's save throughput / np.save of the same bytes gathered on the host
  restore vs orbax, restore other mesh / same mesh (goal <= 1.25)
  peak restore memory, measured in a fresh process, over the state's size (goal <= 2) and
  over what the restored arrays occupy on the mesh: on CPU, "device" buffers live in host
  memory, and a replicated parameter is held once per device, so that is the floor
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

import jax  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position
import orbax.checkpoint as ocp  # pylint: disable=wrong-import-position

from zoo import data
from zoo.run import setup
from zoo.run.config import load_experiment  # pylint: disable=wrong-import-position
from zoo.store import checkpoint  # pylint: disable=wrong-import-position

EXPERIMENTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'experiments')


def _experiment(name):
  return load_experiment(os.path.join(EXPERIMENTS, f'{name}.py'))


def _lm_100mb():
  """A transformer_lm whose params + Adam moments are ~100 MB."""
  c = _experiment('char_lm')
  c.model.num_layers, c.model.d_model, c.model.mlp_dim = 8, 288, 1152
  return c


STATES = {'100MB lm': _lm_100mb, 'char_lm': lambda: _experiment('char_lm'),
          'mlp_digits': lambda: _experiment('mlp_digits')}


def build(config, mesh_shape, materialise=True):
  """(state tree to save, abstract restore target, bytes) on a mesh of shape `mesh_shape`."""
  config.mesh.shape = mesh_shape
  s = setup.build(config, data.load(config.data, config.seed))
  with s.scope():
    target = checkpoint.saved_tree(s.abstract_state())
    tree = None
    if materialise:
      tree = checkpoint.saved_tree(s.create_state())
      jax.block_until_ready(tree)
  size = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(target))
  return tree, target, size


def _timed(fn):
  t0 = time.perf_counter()
  out = fn()
  return time.perf_counter() - t0, out


def _best(fn, repeats):
  return min(fn() for _ in range(repeats))


def measure(name, root, repeats):
  config = STATES[name]()
  tree, target, size = build(config, (4, 2))
  _, other_target, _ = build(config, (2, 4), materialise=False)
  results = {'state': name, 'bytes': size, 'leaves': len(jax.tree.leaves(target))}

  # zoo: the CheckpointManager the trainer uses, async.
  zoo_dir = os.path.join(root, name.replace(' ', '_'), 'zoo')
  manager = checkpoint.make_manager(zoo_dir, keep=100, use_async=True)
  manager.save(0, args=checkpoint.save_args(tree), force=True)  # First save pays setup.
  manager.wait_until_finished()
  blocked, total = [], []
  for step in range(1, repeats + 1):
    t0 = time.perf_counter()
    manager.save(step, args=checkpoint.save_args(tree), force=True)
    blocked.append(time.perf_counter() - t0)
    manager.wait_until_finished()
    total.append(time.perf_counter() - t0)
  i = int(np.argmin(total))
  results.update(zoo_save_blocked_s=blocked[i], zoo_save_total_s=total[i])
  # Same and other mesh alternate, so that drift of this shared machine hits both alike.
  same, other = [], []
  for _ in range(repeats):
    for times, tgt in ((same, target), (other, other_target)):
      times.append(_timed(lambda t=tgt: jax.block_until_ready(
          manager.restore(repeats, args=checkpoint.restore_args(t))))[0])
  results['zoo_restore_same_mesh_s'] = float(np.median(same))
  results['zoo_restore_other_mesh_s'] = float(np.median(other))
  manager.close()

  # Plain orbax on the same pytree.
  plain = ocp.StandardCheckpointer()
  plain_dir = os.path.join(root, name.replace(' ', '_'), 'plain')
  def plain_save(k):
    path = os.path.join(plain_dir, str(k))
    t0 = time.perf_counter()
    plain.save(path, tree)
    plain.wait_until_finished()
    return time.perf_counter() - t0
  plain_save(0)
  results['orbax_save_s'] = min(plain_save(k) for k in range(1, repeats + 1))
  results['orbax_restore_s'] = float(np.median([_timed(lambda: jax.block_until_ready(
      plain.restore(os.path.join(plain_dir, '1'), target)))[0] for _ in range(repeats)]))
  plain.close()

  # The same bytes through numpy: gather on the host, one .npy per leaf, fsync.
  np_dir = os.path.join(root, name.replace(' ', '_'), 'numpy')
  def numpy_save():
    shutil.rmtree(np_dir, ignore_errors=True)
    os.makedirs(np_dir)
    t0 = time.perf_counter()
    for k, leaf in enumerate(jax.tree.leaves(tree)):
      with open(os.path.join(np_dir, f'{k}.npy'), 'wb') as f:
        np.save(f, np.asarray(leaf))
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0
  results['numpy_save_s'] = _best(numpy_save, repeats)

  # Peak host memory of a restore, in a fresh process that holds nothing else.
  out = subprocess.run([sys.executable, __file__, f'--restore_memory={name}', f'--dir={zoo_dir}',
                        f'--step={repeats}'], capture_output=True, text=True, check=True)
  results['restore_peak_rss_increase_bytes'], results['restored_resident_bytes'] = json.loads(
      out.stdout.strip().splitlines()[-1])
  return results


def _rss(field):
  with open('/proc/self/status', encoding='utf-8') as f:
    for line in f:
      if line.startswith(field):
        return int(line.split()[1]) * 1024
  raise KeyError(field)


def restore_memory(name, directory, step):
  """Prints the rise of peak RSS over the RSS before the restore."""
  _, target, _ = build(STATES[name](), (4, 2), materialise=False)
  manager = checkpoint.make_manager(directory, keep=100, use_async=False)
  before = _rss('VmRSS:')
  with open('/proc/self/clear_refs', 'w', encoding='utf-8') as f:
    f.write('5')  # Resets VmHWM to the current RSS (Linux).
  restored = manager.restore(step, args=checkpoint.restore_args(target))
  jax.block_until_ready(restored)
  resident = sum(s.data.nbytes for leaf in jax.tree.leaves(restored) for s in leaf.addressable_shards)
  print(json.dumps([_rss('VmHWM:') - before, resident]))


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--out', default='checkpoint_bench.json')
  parser.add_argument('--repeats', type=int, default=7)
  parser.add_argument('--restore_memory')
  parser.add_argument('--dir')
  parser.add_argument('--step', type=int)
  args = parser.parse_args()
  if args.restore_memory:
    restore_memory(args.restore_memory, args.dir, args.step)
    return
  root = tempfile.mkdtemp(prefix='zoo_ckpt_bench_')
  try:
    rows = [measure(name, root, args.repeats) for name in STATES]
  finally:
    shutil.rmtree(root, ignore_errors=True)
  header = ('state', 'MB', 'leaves', 'save s', 'blocked/total', 'save vs orbax', 'save vs numpy',
            'restore s', 'restore vs orbax', 'other mesh/same', 'peak mem/state',
            'peak mem/resident')
  table = [header]
  for r in rows:
    table.append((r['state'], f"{r['bytes'] / 1e6:.1f}", str(r['leaves']),
                  f"{r['zoo_save_total_s']:.3f}",
                  f"{r['zoo_save_blocked_s'] / r['zoo_save_total_s']:.0%}",
                  f"{r['orbax_save_s'] / r['zoo_save_total_s']:.2f}x",
                  f"{r['numpy_save_s'] / r['zoo_save_total_s']:.2f}x",
                  f"{r['zoo_restore_same_mesh_s']:.3f}",
                  f"{r['orbax_restore_s'] / r['zoo_restore_same_mesh_s']:.2f}x",
                  f"{r['zoo_restore_other_mesh_s'] / r['zoo_restore_same_mesh_s']:.2f}x",
                  f"{r['restore_peak_rss_increase_bytes'] / r['bytes']:.2f}x",
                  f"{r['restore_peak_rss_increase_bytes'] / r['restored_resident_bytes']:.2f}x"))
  widths = [max(len(row[i]) for row in table) for i in range(len(header))]
  for row in table:
    print('  '.join(c.rjust(w) for c, w in zip(row, widths)))
  with open(args.out, 'w', encoding='utf-8') as f:
    json.dump(rows, f, indent=2)


if __name__ == '__main__':
  main()
