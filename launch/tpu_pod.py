r"""Runs one zoo command on every worker of a Cloud TPU pod slice (a TPU VM).

    python launch/tpu_pod.py --tpu=my-v5p-64 --accelerator_type=v5p-64 --zone=us-east5-a \
        [--project=P] [--dry_run] -- \
        --config=experiments/char_lm.py --workdir=gs://my-bucket/runs/lm --config.mesh.shape="(-1,4)"

Before it touches any VM it plans the run here for the slice's accelerator type
(`python -m zoo.main ... --dry_run --topology=TYPE`: the TPU compiler compiles the train and
eval steps for the pod's layout on this machine, which needs `pip install -e '.[tpu]'`)
and stops if the plan fails or does not fit; its output goes to stderr (--skip_plan skips
it). Then it packs the committed tree (`git archive HEAD`), copies it to every worker,
installs it with its `tpu` and `gcs` extras (`pip install -e '.[tpu,gcs]'`: JAX with libtpu,
gcsfs for gs:// workdirs), and starts `python -m zoo.main` on all workers at once
(`--worker=all`). On a TPU VM zoo auto-detects the pod and calls jax.distributed.initialize,
so no coordinator flags are needed. The workdir is a gs:// bucket path or a directory every
worker mounts (NFS). --dry_run prints the exact commands instead of running them.
"""
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


def plan_command(accelerator_type, zoo_args):
  """zoo.main's dry run of the same arguments, compiled for the slice on this machine."""
  return [sys.executable, '-m', 'zoo.main', *zoo_args, '--dry_run',
          f'--topology={accelerator_type}']


def main():
  parser = cli.parser(__doc__)
  parser.add_argument('--tpu', required=True, help='TPU VM name.')
  parser.add_argument('--accelerator_type', required=True,
                      help="The slice's accelerator type (v5p-64, v5litepod-256, ...): the plan "
                           'compiles for it before any VM is touched.')
  parser.add_argument('--zone', required=True)
  parser.add_argument('--project', default=None)
  parser.add_argument('--dry_run', action='store_true', help='Print the commands; run nothing on '
                      'the VMs (the plan still runs here).')
  parser.add_argument('--skip_plan', action='store_true',
                      help='Do not compile the run for the slice first.')
  cli.add_zoo_args(parser)
  args = parser.parse_args()
  zoo_args = cli.zoo_args(parser, args)
  if not args.skip_plan:
    plan = plan_command(args.accelerator_type, zoo_args)
    print(f'[launch] planning for {args.accelerator_type}: {shlex.join(plan)}', file=sys.stderr,
          flush=True)
    planned = subprocess.run(plan, cwd=REPO, stdout=sys.stderr, check=False)
    if planned.returncode:
      sys.exit(f'zoo: error: tpu_pod.py: the plan for {args.accelerator_type} failed (above); '
               'no VM was touched')
  for cmd in commands(args.tpu, args.zone, args.project, zoo_args):
    print(shlex.join(cmd), flush=True)
    if not args.dry_run:
      try:
        done = subprocess.run(cmd, check=False)
      except OSError as e:  # No gcloud here.
        sys.exit(f'zoo: error: tpu_pod.py: {cmd[0]}: {e.strerror or e}; install the Google Cloud '
                 'CLI (gcloud) and log in')
      if done.returncode:
        sys.exit(f'zoo: error: tpu_pod.py: {shlex.join(cmd[:4])} ... exited with status '
                 f'{done.returncode} (its output is above)')


if __name__ == '__main__':
  sys.exit(main())
