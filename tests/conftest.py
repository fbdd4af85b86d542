"""Tests run on 8 emulated CPU devices, set up before JAX initialises."""
import json
import os
import subprocess
import sys

os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'
os.environ['JAX_PLATFORMS'] = 'cpu'

import pytest  # pylint: disable=wrong-import-position

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def experiment(name):
  return os.path.join(REPO, 'experiments', f'{name}.py')


def load_config(name, arg='smoke', **overrides):
  """An experiment's config with dotted overrides, e.g. {'train.steps': 5}."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  spec = importlib.util.spec_from_file_location(name, experiment(name))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config(arg)
  for key, value in overrides.items():
    *groups, leaf = key.split('.')
    node = config
    for g in groups:
      node = node[g]
    node[leaf] = value
  return config


def read_metrics(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
    return [json.loads(line) for line in f]


def run_cli(*args, devices=8, timeout=300):
  """Runs `python -m zoo.main ARGS` on `devices` emulated CPU devices."""
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  cmd = [sys.executable, '-m', 'zoo.main', f'--cpu_devices={devices}', *args]
  return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                        check=False)


@pytest.fixture(scope='session')
def devices():
  import jax  # pylint: disable=import-outside-toplevel
  assert jax.device_count() == 8, 'tests expect 8 emulated CPU devices'
  return jax.devices()
