"""The cloud launchers cannot run here: their dry-run output is checked instead."""
import os
import re
import shlex
import subprocess
import sys

import pytest

from conftest import REPO, cli_env

# A run that fits (smoke: the TPU compiler plans it in 4 s instead of char_lm's 10).
ZOO_ARGS = ['--config=experiments/char_lm.py:smoke', '--workdir=/mnt/runs/lm',
            '--config.mesh.shape=(-1, 4)']


def _run(script, *args):
  result = subprocess.run([sys.executable, f'launch/{script}', *args, '--dry_run', '--', *ZOO_ARGS],
                          cwd=REPO, capture_output=True, text=True, check=False)
  assert result.returncode == 0, result.stderr
  return result.stdout


def test_tpu_pod_dry_run_deploys_and_runs_on_every_worker():
  lines = _run('tpu_pod.py', '--tpu=pod', '--accelerator_type=v5p-16', '--zone=us-east5-a',
               '--project=p').splitlines()
  assert lines[0] == shlex.join(['git', '-C', REPO, 'archive', '--format=tar.gz',
                                 '--output=/tmp/zoo-pod.tar.gz', 'HEAD'])
  assert lines[1] == ("gcloud compute tpus tpu-vm scp /tmp/zoo-pod.tar.gz 'pod:~/zoo.tar.gz' "
                      '--worker=all --zone=us-east5-a --project=p')
  ssh = shlex.split(lines[2])
  assert ssh[:8] == ['gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh', 'pod', '--worker=all',
                     '--zone=us-east5-a']
  remote = ssh[-1].removeprefix('--command=')
  assert "pip install -q -e '.[tpu,gcs]' && " in remote  # JAX with libtpu; gs:// workdirs.
  # The user's arguments reach zoo.main intact, quoting included.
  assert shlex.split(remote.split('python3 -m zoo.main ')[1]) == ZOO_ARGS
  assert len(lines) == 3


def test_tpu_pod_refuses_a_run_the_slice_cannot_fit_before_touching_a_vm():
  """The plan runs here first, for the slice (the test above passed one that fits); a config
  the TPU compiler refuses stops the launcher before any command, with its figures. The
  plan (zoo.main --dry_run, its output on the launcher's stderr) is char_lm:1b
  data-parallel on v5litepod-16: the TPU compiler's own out-of-memory verdict, one line
  with the figures and what to change, exit 1 (topology_test's plans, without a second
  compile of this step)."""
  pytest.importorskip('libtpu')
  env = cli_env()
  refused = subprocess.run([sys.executable, 'launch/tpu_pod.py', '--tpu=pod',
                            '--accelerator_type=v5litepod-16', '--zone=z', '--dry_run', '--',
                            '--config=experiments/char_lm.py:1b', '--workdir=gs://b/r',
                            '--config.mesh.shape=(16,1)'], cwd=REPO, env=env, capture_output=True,
                           text=True, check=False)
  assert refused.returncode == 1 and not refused.stdout  # No command was printed or run.
  assert re.search(r'DOES NOT FIT: the compiler refused the train step, which needs [0-9.]+ GiB '
                   r"per device of 15.75 GiB per device \(the TPU compiler's usable HBM\)",
                   refused.stderr), refused.stderr[-2000:]
  *_, plan, last = refused.stderr.strip().splitlines()
  assert re.fullmatch(r"zoo: the train step needs [0-9.]+ GiB per device, more than the 15\.75 "
                      r"GiB per device that v5litepod-16 allows \(the TPU compiler's usable HBM\); "
                      r'shard more \(mesh, rules: fsdp_rules\), .*model\.attention=splash.*',
                      plan), plan
  assert float(re.search(r'needs ([0-9.]+) GiB', plan).group(1)) > 15.75
  assert last == 'zoo: error: tpu_pod.py: the plan for v5litepod-16 failed (above); no VM was touched'


def test_slurm_dry_run_one_process_per_gpu():
  script = _run('slurm.py', '--nodes=4', '--gpus_per_node=8', '--per=gpu', '--time=02:00:00')
  assert script.startswith('#!/bin/bash\n')
  for line in ('#SBATCH --nodes=4', '#SBATCH --ntasks-per-node=8', '#SBATCH --gpus-per-node=8',
               '#SBATCH --time=02:00:00', '#SBATCH --signal=TERM@120'):
    assert line in script.splitlines()
  lines = script.splitlines()
  srun = [l for l in lines if l.startswith('srun')][0]
  # zoo and JAX's CUDA 12 plugin installed once, before the tasks start.
  assert lines.index("python -m pip install -q -e '.[cuda12]'") < lines.index(srun)
  # No per-task GPU binding: JAX picks the GPU at the task's local rank among all it sees.
  assert srun.startswith('srun --kill-on-bad-exit=1 python -m zoo.main ')
  assert 'JAX_LOCAL_DEVICE_IDS' not in script
  assert shlex.split(srun.split('zoo.main ')[1]) == ZOO_ARGS


def test_slurm_dry_run_one_process_per_node():
  script = _run('slurm.py', '--nodes=2', '--per=node')
  lines = script.splitlines()
  assert '#SBATCH --ntasks-per-node=1' in lines
  assert 'export JAX_LOCAL_DEVICE_IDS=0,1,2,3,4,5,6,7' in lines  # All 8 GPUs to the one process.
  assert lines.index('export JAX_LOCAL_DEVICE_IDS=0,1,2,3,4,5,6,7') < [
      i for i, l in enumerate(lines) if l.startswith('srun')][0]


def test_slurm_dry_run_without_install():
  script = _run('slurm.py', '--nodes=1', '--no_install')
  assert 'pip install' not in script


def test_accelerator_extras_are_jax_own():
  import tomllib  # pylint: disable=import-outside-toplevel
  with open(f'{REPO}/pyproject.toml', 'rb') as f:
    extras = tomllib.load(f)['project']['optional-dependencies']
  assert extras['cuda12'] == ['jax[cuda12]>=0.10.2'] and extras['tpu'] == ['jax[tpu]>=0.10.2']


def test_launchers_need_zoo_arguments():
  result = subprocess.run([sys.executable, 'launch/slurm.py', '--nodes=1', '--dry_run'], cwd=REPO,
                          capture_output=True, text=True, check=False)
  assert result.returncode == 2 and 'give the zoo.main arguments' in result.stderr


AFTER = ['--', '--config=experiments/mlp_digits.py:smoke', '--workdir=/nonexistent/x']


@pytest.mark.parametrize('launcher,args', [
    ('local.py', ['--processes=0', '--timeout=1', *AFTER]),
    ('local.py', ['--devices=-1', *AFTER]),
    ('local.py', ['--processes=1000000000', *AFTER]),
    ('local.py', ['--heartbeat_timeout=0', *AFTER]),
    ('local.py', ['--timeout=nan', *AFTER]),
    ('local.py', ['--processes=abc', *AFTER]),
    ('slurm.py', ['--nodes=0', '--dry_run', *AFTER]),
    ('slurm.py', ['--nodes=2', '--gpus_per_node=-8', '--dry_run', *AFTER]),
    ('slurm.py', ['--nodes=2', '--time=soon', '--dry_run', *AFTER]),
    ('slurm.py', ['--nodes=2', '--per=core', '--dry_run', *AFTER]),
    ('slurm.py', ['--nodes=2', '--job_name=a b;rm', '--dry_run', *AFTER]),
    ('slurm.py', ['--dry_run', *AFTER]),
    ('tpu_pod.py', ['--tpu=t', '--zone=z', '--dry_run', *AFTER]),
    ('tpu_pod.py', ['--tpu=t', '--zone=z', '--accelerator_type=v5p-64', '--dry_run']),
])
def test_bad_launcher_flags_are_one_line(launcher, args):
  """The launchers end as zoo's commands do: one `zoo: error:` line naming the flag, no
  usage block, no traceback, argparse's status 2; nothing is started."""
  result = subprocess.run([sys.executable, os.path.join('launch', launcher), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=False)
  lines = result.stderr.strip().splitlines()
  assert result.returncode == 2 and len(lines) == 1, result.stderr
  assert lines[0].startswith(f'zoo: error: {launcher}: ') and 'Traceback' not in result.stderr
