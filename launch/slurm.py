r"""Writes (and submits) a SLURM batch script that runs one zoo command on a GPU cluster.

    python launch/slurm.py --nodes=4 --gpus_per_node=8 --per=gpu --time=04:00:00 [--dry_run] -- \
        --config=experiments/char_lm.py --workdir=/shared/runs/lm --config.mesh.shape="(-1,8)"

`srun` starts one process per GPU (--per=gpu) or per node (--per=node). zoo detects SLURM and
calls jax.distributed.initialize, which reads the job's nodes, task count and rank from
SLURM's environment. Every task sees all of its node's GPUs: per GPU, JAX takes the one at
the task's local rank; per node, JAX_LOCAL_DEVICE_IDS hands the process all of them. The workdir must be on
a file system that every node sees. The script first installs zoo with its `cuda12` extra
(JAX's CUDA 12 plugin, CUDA and cuDNN from pip) into the Python environment that sbatch
runs in, shared by the nodes (--no_install skips it). --dry_run prints the script instead
of calling sbatch.
"""
import re
import shlex
import subprocess
import sys

import cli


def batch_script(nodes, gpus_per_node, per, time_limit, job_name, zoo_args, partition=None,
                 install=True):
  tasks = gpus_per_node if per == 'gpu' else 1
  lines = [
      '#!/bin/bash',
      f'#SBATCH --job-name={job_name}',
      f'#SBATCH --nodes={nodes}',
      f'#SBATCH --ntasks-per-node={tasks}',
      f'#SBATCH --gpus-per-node={gpus_per_node}',
      f'#SBATCH --time={time_limit}',
      '#SBATCH --output=%x-%j.out',
      # SIGTERM 120 s before the time limit: zoo saves a checkpoint and exits 0.
      '#SBATCH --signal=TERM@120',
  ]
  if partition:
    lines.append(f'#SBATCH --partition={partition}')
  lines.append('set -euo pipefail')
  if install:  # Once, from the first node, into the environment that every node shares.
    lines.append("python -m pip install -q -e '.[cuda12]'")
  if per == 'node':  # Else JAX's SLURM detection gives each process only GPU 0.
    lines.append(f'export JAX_LOCAL_DEVICE_IDS={",".join(str(i) for i in range(gpus_per_node))}')
  lines += [
      '# One process per task; every process runs the same command.',
      f'srun --kill-on-bad-exit=1 python -m zoo.main {shlex.join(zoo_args)}',
  ]
  return '\n'.join(lines) + '\n'


def main():
  parser = cli.parser(__doc__)
  parser.add_argument('--nodes', type=int, required=True)
  parser.add_argument('--gpus_per_node', type=int, default=8)
  parser.add_argument('--per', choices=('gpu', 'node'), default='gpu', help='One process per GPU or per node.')
  parser.add_argument('--time', default='01:00:00')
  parser.add_argument('--job_name', default='zoo')
  parser.add_argument('--partition', default=None)
  parser.add_argument('--no_install', action='store_true',
                      help="Skip `pip install -e '.[cuda12]'` (the environment already has zoo).")
  parser.add_argument('--dry_run', action='store_true', help='Print the script; submit nothing.')
  cli.add_zoo_args(parser)
  args = parser.parse_args()
  zoo_args = cli.zoo_args(parser, args)
  if args.nodes < 1 or args.gpus_per_node < 1:
    parser.error('--nodes and --gpus_per_node must be positive')
  if not re.fullmatch(r'(\d+-)?\d+(:\d\d){0,2}', args.time):
    parser.error(f'--time={args.time!r} is not a SLURM time limit; give HH:MM:SS or D-HH:MM:SS')
  if not re.fullmatch(r'[\w.-]+', args.job_name):
    parser.error(f'--job_name={args.job_name!r}: use letters, digits, ".", "_" and "-"')
  script = batch_script(args.nodes, args.gpus_per_node, args.per, args.time, args.job_name,
                        zoo_args, args.partition, install=not args.no_install)
  if args.dry_run:
    print(script, end='')
  else:
    try:
      done = subprocess.run(['sbatch'], input=script, text=True, check=False)
    except OSError as e:  # Not on a SLURM login node.
      sys.exit(f'zoo: error: slurm.py: sbatch: {e.strerror or e}; run this on a SLURM login '
               'node, or --dry_run to print the script')
    if done.returncode:
      sys.exit(f'zoo: error: slurm.py: sbatch exited with status {done.returncode} (its output '
               'is above)')


if __name__ == '__main__':
  sys.exit(main())
