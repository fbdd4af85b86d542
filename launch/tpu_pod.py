r"""Runs one zoo command on every worker of a Cloud TPU pod slice (a TPU VM).

    python launch/tpu_pod.py --tpu=my-v5p-64 --zone=us-east5-a [--project=P] [--dry_run] -- \
        --config=experiments/char_lm.py --workdir=gs://my-bucket/runs/lm --config.mesh.shape="(-1,4)"

It packs the committed tree (`git archive HEAD`), copies it to every worker, installs it with
its `tpu` and `gcs` extras (`pip install -e '.[tpu,gcs]'`: JAX with libtpu, gcsfs for gs://
workdirs), and starts `python -m zoo.main` on all workers at once (`--worker=all`). On a TPU
VM zoo auto-detects the pod and calls jax.distributed.initialize, so no coordinator flags
are needed. The workdir is a gs:// bucket path or a directory every worker mounts (NFS).
--dry_run prints the exact commands instead of running them.
"""
import argparse
import os
import shlex
import subprocess
import sys

import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def commands(tpu, zone, project, zoo_args, remote_dir='~/zoo'):
  """The commands, each a list of arguments, that deploy and run on every worker."""
  archive = f'/tmp/zoo-{tpu}.tar.gz'
  where = [f'--zone={zone}'] + ([f'--project={project}'] if project else [])
  run = (f'mkdir -p {remote_dir} && tar -xzf ~/zoo.tar.gz -C {remote_dir} && cd {remote_dir} && '
         f"python3 -m pip install -q -e '.[tpu,gcs]' && "
         f'python3 -m zoo.main {shlex.join(zoo_args)}')
  return [
      ['git', '-C', REPO, 'archive', '--format=tar.gz', f'--output={archive}', 'HEAD'],
      ['gcloud', 'compute', 'tpus', 'tpu-vm', 'scp', archive, f'{tpu}:~/zoo.tar.gz', '--worker=all', *where],
      ['gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh', tpu, '--worker=all', *where, f'--command={run}'],
  ]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--tpu', required=True, help='TPU VM name.')
  parser.add_argument('--zone', required=True)
  parser.add_argument('--project', default=None)
  parser.add_argument('--dry_run', action='store_true', help='Print the commands; run nothing.')
  cli.add_zoo_args(parser)
  args = parser.parse_args()
  zoo_args = cli.zoo_args(parser, args)
  for cmd in commands(args.tpu, args.zone, args.project, zoo_args):
    print(shlex.join(cmd), flush=True)
    if not args.dry_run:
      subprocess.run(cmd, check=True)


if __name__ == '__main__':
  sys.exit(main())
