r"""Step benchmark: what zoo's machinery costs, compile times, time to first step. Not a test.

    python benchmarks/step_bench.py [--out=step_bench.json] [--repeats=7] [--skip=...]
    # On an accelerator, e.g. one GPU (--cpu_devices=0: the machine's own devices):
    python benchmarks/step_bench.py --cpu_devices=0 --meshes=1,1 \
        --experiments=char_lm:100m,char_lm:1b --skip=compile,startup,checkpoint

By default on 8 emulated CPU devices, it prints one table per part and writes them as JSON:
  overhead  zoo's jitted train step against a minimal hand-written `jax.jit` step of the
            same model, optimizer and shardings (value_and_grad + optax, params and
            optimizer state donated), for the full char_lm and mlp_digits on meshes (8,1),
            (4,2), (2,4). Both get the same device-resident batch; blocks of --steps steps
            alternate between the two, --repeats times. The ratio is of the best blocks
            (noise on a shared machine only adds time); medians are in the JSON. Goal <= 1.05x.
            MFU is model FLOPs (zoo.run.perf) / step time / the devices' peak (zoo.run.perf: on
            CPU this host's measured f32 matmul peak; else the data sheet's bf16 peak).
  compile   seconds to lower and compile the train step of char_lm's width at 4 and 48
            layers, unrolled and under nn.scan (no persistent cache).
  startup   time to first step: a whole 1-step `python -m zoo.main` run of char_lm
            (start, init, compile, step, eval, save, exit) with an empty
            --compilation_cache_dir, then again with it warm, and the train step's compile
            time logged by each.
  checkpoint  char_lm's state saved (async: loop blocked / total) and restored, on the
            same mesh and another, from benchmarks/checkpoint_bench.py.
"""
import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time

_pre = argparse.ArgumentParser(add_help=False)
_pre.add_argument('--cpu_devices', type=int, default=8)
if _pre.parse_known_args()[0].cpu_devices:  # Before JAX starts.
  os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count='
                        f'{_pre.parse_known_args()[0].cpu_devices}')
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
for _var in ('JAX_COMPILATION_CACHE_DIR',):  # Compile times must be real.
  os.environ.pop(_var, None)
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..')
sys.path.insert(0, ROOT)

import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position
import optax  # pylint: disable=wrong-import-position

from zoo import data  # pylint: disable=wrong-import-position
from zoo.data import feed  # pylint: disable=wrong-import-position
from zoo.run import perf, setup
from zoo.run.config import load_experiment  # pylint: disable=wrong-import-position

EXPERIMENTS = os.path.join(ROOT, 'experiments')
MESHES = ((8, 1), (4, 2), (2, 4))


def _config(name, **model):
  """`name` is an experiment, with an optional variant: 'char_lm:100m'."""
  name, _, arg = name.partition(':')
  config = load_experiment(os.path.join(EXPERIMENTS, f'{name}.py'), arg or None)
  config.model.update(model)
  return config


def hand_written_step(model, tx):
  """The plainest train step: cross-entropy, value_and_grad, optax update."""
  def loss_fn(params, batch):
    logits = model.apply({'params': params}, batch['inputs'])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch['targets']).mean()

  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
  return step


def _timed_steps(run_steps, count):
  t0 = time.perf_counter()
  jax.block_until_ready(run_steps(count))
  return (time.perf_counter() - t0) / count


def overhead(name, mesh_shape, block_steps, repeats, peak):
  config = _config(name)
  config.mesh.shape = mesh_shape
  dataset = data.load(config.data, config.seed)
  s = setup.build(config, dataset)
  with s.scope():
    batch = feed.TrainBatches(dataset, s.placement, config.train.batch_size,
                          arrange=s.arrange)(0)
    zoo_state = s.create_state()
    train_step = s.jit_train_step()
    shardings = s.state_shardings
    hand = jax.jit(hand_written_step(s.model, s.optimizer),
                   in_shardings=(shardings.params, shardings.opt_state,
                                 s.placement.shardings(s.batch)),
                   out_shardings=(shardings.params, shardings.opt_state, None),
                   donate_argnums=(0, 1))
    hand_state = [jax.tree.map(jnp.copy, zoo_state.params), jax.tree.map(jnp.copy, zoo_state.opt_state)]
    box = {'zoo': zoo_state}

    def zoo_steps(n):
      for _ in range(n):
        box['zoo'], metrics = train_step(box['zoo'], batch)
      return metrics

    def hand_steps(n):
      for _ in range(n):
        hand_state[0], hand_state[1], loss = hand(hand_state[0], hand_state[1], batch)
      return loss

    zoo_steps(3)
    hand_steps(3)  # Compiled and warm.
    zoo_times, hand_times = [], []
    for _ in range(repeats):
      zoo_times.append(_timed_steps(zoo_steps, block_steps))
      hand_times.append(_timed_steps(hand_steps, block_steps))
    compiled = train_step.lower(box['zoo'], batch).compile()
  flops = perf.step_cost(s, box['zoo'], compiled)['model_flops']
  zoo_s, hand_s = min(zoo_times), min(hand_times)
  return {'experiment': name, 'mesh': list(mesh_shape), 'zoo_step_s': zoo_s,
          'hand_step_s': hand_s, 'ratio': zoo_s / hand_s, 'model_flops': flops,
          'zoo_median_s': float(np.median(zoo_times)), 'hand_median_s': float(np.median(hand_times)),
          'mfu': perf.mfu(flops, zoo_s, s.mesh.size, peak)}


def compile_time(layers, scan):
  config = _config('char_lm', num_layers=layers, scan_layers=scan)
  config.mesh.shape = (4, 2)
  dataset = data.load(config.data, config.seed)
  s = setup.build(config, dataset)
  with s.scope():
    abstract = s.abstract_state()
    t0 = time.perf_counter()
    lowered = s.jit_train_step().lower(abstract, s.batch)
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
  return {'layers': layers, 'scan': scan, 'lower_s': t1 - t0, 'compile_s': t2 - t1}


def startup(root):
  """Two 1-step runs of char_lm sharing a compilation cache: cold, then warm."""
  cache = os.path.join(root, 'cache')
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  results = []
  for label in ('cold', 'warm'):
    workdir = os.path.join(root, label)
    cmd = [sys.executable, '-m', 'zoo.main', f'--config={EXPERIMENTS}/char_lm.py',
           f'--workdir={workdir}', '--cpu_devices=8', '--config.mesh.shape=(4,2)',
           '--config.train.steps=1', '--config.eval.max_batches=1',
           f'--compilation_cache_dir={cache}']
    t0 = time.perf_counter()
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    compile_s = float(re.search(r'compiled the train step in ([\d.]+) s', out.stderr).group(1))
    cached = re.search(r'XLA compilation cache: (\d+) programs loaded from the cache, (\d+) compiled',
                       out.stderr)
    results.append({'cache': label, 'run_s': wall, 'train_step_compile_s': compile_s,
                    'programs_loaded': int(cached.group(1)), 'programs_compiled': int(cached.group(2))})
  return results


def checkpoint_figures(root, repeats):
  spec = importlib.util.spec_from_file_location(
      'checkpoint_bench', os.path.join(os.path.dirname(os.path.abspath(__file__)), 'checkpoint_bench.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  r = module.measure('char_lm', root, repeats)
  return {'state': 'char_lm', 'bytes': r['bytes'], 'save_blocked_s': r['zoo_save_blocked_s'],
          'save_total_s': r['zoo_save_total_s'], 'restore_same_mesh_s': r['zoo_restore_same_mesh_s'],
          'restore_other_mesh_s': r['zoo_restore_other_mesh_s']}


def _table(title, rows, columns):
  print(f'\n{title}')
  cells = [[fmt(r[key]) for key, fmt in columns.values()] for r in rows]
  widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(columns)]
  print('  '.join(h.rjust(w) for h, w in zip(columns, widths)))
  for c in cells:
    print('  '.join(x.rjust(w) for x, w in zip(c, widths)))


def main():
  parser = argparse.ArgumentParser(parents=[_pre])
  parser.add_argument('--out', default='step_bench.json')
  parser.add_argument('--experiments', default='char_lm,mlp_digits')
  parser.add_argument('--meshes', default=';'.join(f'{a},{b}' for a, b in MESHES),
                      help='mesh shapes for the overhead part, e.g. "8,1;4,2"')
  parser.add_argument('--steps', type=int, default=10)
  parser.add_argument('--repeats', type=int, default=7)
  parser.add_argument('--skip', default='', help='comma-separated parts to skip: '
                      'overhead, compile, startup, checkpoint')
  args = parser.parse_args()
  skip = set(filter(None, args.skip.split(',')))
  peak, source = perf.peak_flops()
  device = jax.devices()[0]
  results = {'machine': {'cpus': os.cpu_count(), 'devices': jax.device_count(),
                         'device_kind': device.device_kind, 'jax': jax.__version__,
                         'peak_flops_per_device': peak, 'peak_source': source}}
  print(f'{os.cpu_count()} CPUs, {jax.device_count()} x {device.device_kind}, jax {jax.__version__}; '
        f'peak {perf.format_flops(peak)}/s per device ({source})')
  s3, pct, num = (lambda x: f'{x:.4f}'), (lambda x: f'{100 * x:.1f}%'), str
  if 'overhead' not in skip:
    meshes = [tuple(int(x) for x in m.split(',')) for m in args.meshes.split(';')]
    rows = [overhead(name, mesh, args.steps, args.repeats, peak)
            for name in args.experiments.split(',') for mesh in meshes]
    results['overhead'] = rows
    _table('zoo step vs hand-written jax.jit step (s/step, best block)', rows, {
        'experiment': ('experiment', num), 'mesh': ('mesh', lambda m: str(tuple(m))),
        'zoo s': ('zoo_step_s', s3), 'hand s': ('hand_step_s', s3),
        'zoo/hand': ('ratio', lambda x: f'{x:.3f}'), 'MFU': ('mfu', pct)})
  if 'compile' not in skip:
    rows = [compile_time(layers, scan) for layers in (4, 48) for scan in (False, True)]
    results['compile'] = rows
    _table('train step compile time, char_lm width, mesh (4,2)', rows, {
        'layers': ('layers', num), 'scan': ('scan', num), 'lower s': ('lower_s', lambda x: f'{x:.1f}'),
        'compile s': ('compile_s', lambda x: f'{x:.1f}')})
  with tempfile.TemporaryDirectory() as root:
    if 'startup' not in skip:
      rows = startup(root)
      results['startup'] = rows
      _table('time to first step: a 1-step char_lm run, (4,2)', rows, {
          'cache': ('cache', num), 'run s': ('run_s', lambda x: f'{x:.1f}'),
          'step compile s': ('train_step_compile_s', lambda x: f'{x:.2f}'),
          'loaded': ('programs_loaded', num), 'compiled': ('programs_compiled', num)})
    if 'checkpoint' not in skip:
      row = checkpoint_figures(root, 3)
      results['checkpoint'] = row
      _table('checkpoint (char_lm, mesh (4,2))', [row], {
          'MB': ('bytes', lambda x: f'{x / 1e6:.1f}'), 'save blocked s': ('save_blocked_s', s3),
          'save total s': ('save_total_s', s3), 'restore s': ('restore_same_mesh_s', s3),
          'restore on (2,4) s': ('restore_other_mesh_s', s3)})
  with open(args.out, 'w', encoding='utf-8') as f:
    json.dump(results, f, indent=2)
  print(f'\nwrote {args.out}')


if __name__ == '__main__':
  main()
