"""A host without accelerators trains on one emulated CPU device per core by default."""
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, cli_env, experiment
from zoo.parallel import distributed


@pytest.mark.parametrize('cores,devices', [(1, 1), (2, 2), (3, 2), (6, 4), (16, 16)])
def test_one_device_per_core_rounded_to_a_power_of_two(cores, devices, monkeypatch):
  monkeypatch.setattr(os, 'sched_getaffinity', lambda pid: set(range(cores)))
  assert distributed.cores_as_devices() == devices


def test_default_run_uses_every_core_data_parallel(tmp_path):
  env = cli_env()  # No device count given.
  result = subprocess.run(
      [sys.executable, '-m', 'zoo.main', f'--config={experiment("mlp_digits")}:smoke',
       f'--workdir={tmp_path}', '--config.train.steps=2'],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=180, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  n = distributed.cores_as_devices()
  assert (f'no accelerator: {n} CPU devices, one per core (--cpu_devices=N to choose)'
          in result.stderr)
  assert json.loads((tmp_path / 'model_info.json').read_text())['mesh'] == {'batch': n, 'model': 1}
