r"""Per-device bytes of parameters and optimizer state: standard rules vs the FSDP preset.

    python benchmarks/fsdp_bytes.py [--experiment=char_lm] [--devices=8]

Abstract: builds the state's shapes and shardings on emulated CPU devices, allocates
nothing, and prints a table (and JSON with --json=FILE).
"""
import argparse
import json
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--experiment', default='char_lm')
  parser.add_argument('--devices', type=int, default=8)
  parser.add_argument('--json', default='')
  args = parser.parse_args()
  os.environ['XLA_FLAGS'] = f'--xla_force_host_platform_device_count={args.devices}'
  os.environ['JAX_PLATFORMS'] = 'cpu'
  import jax  # pylint: disable=import-outside-toplevel
  from zoo.store import checkpoint  # pylint: disable=import-outside-toplevel
  from zoo import data
  from zoo.run import setup
  from zoo.parallel import sharding
  from zoo.parallel import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
  from zoo.run.config import load_experiment  # pylint: disable=import-outside-toplevel

  config = load_experiment(os.path.join(REPO, 'experiments', f'{args.experiment}.py'))
  dataset = data.load(config.data, config.seed)
  n = args.devices
  rows = []
  for shape in [(n, 1), (n // 2, 2), (1, n)]:
    mesh = mesh_lib.make_mesh(shape, config.mesh.axes)
    for preset, rules in (('standard', sharding.standard_rules()), ('fsdp', sharding.fsdp_rules())):
      config.logical_axis_rules = rules
      s = setup.build(config, dataset, mesh)
      with s.scope():
        # Shapes carrying the shardings: what a restore would read into.
        target = checkpoint.saved_tree(s.abstract_state())
      params, opt = target['params'], target['opt_state']
      total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((params, opt)))
      rows.append({'mesh': list(shape), 'rules': preset, 'total_bytes': total,
                   'params_bytes_per_device': sharding.per_device_bytes(params),
                   'opt_state_bytes_per_device': sharding.per_device_bytes(opt)})
  print(f'{args.experiment}: parameters + AdamW state, {rows[0]["total_bytes"] / 2**20:.2f} MiB in all')
  print(f'{"mesh":>8} {"rules":>9} {"params/device":>14} {"optimizer/device":>17} {"fraction":>9}')
  for r in rows:
    per = r['params_bytes_per_device'] + r['opt_state_bytes_per_device']
    print(f'{str(tuple(r["mesh"])):>8} {r["rules"]:>9} {r["params_bytes_per_device"] / 2**20:>10.3f} MiB'
          f' {r["opt_state_bytes_per_device"] / 2**20:>13.3f} MiB {per / r["total_bytes"]:>9.3f}')
  if args.json:
    with open(args.json, 'w', encoding='utf-8') as f:
      json.dump(rows, f, indent=2)


if __name__ == '__main__':
  main()
