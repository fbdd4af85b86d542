"""Profiling: profile.steps=(a, b) traces those steps into workdir/profile."""
import glob
import gzip
import json
import os

from conftest import load_config
from zoo.run import train


def test_profile_traces_the_chosen_steps(tmp_path, devices):
  del devices
  config = load_config('mlp_digits', **{'train.steps': 6, 'eval.every_steps': 6,
                                        'checkpoint.every_steps': 6, 'profile.steps': (2, 4)})
  train.train_and_evaluate(config, str(tmp_path))
  runs = glob.glob(os.path.join(tmp_path, 'profile', 'plugins', 'profile', '*'))
  assert len(runs) == 1, runs  # One trace, TensorBoard's layout.
  assert glob.glob(os.path.join(runs[0], '*.xplane.pb'))
  [perfetto] = glob.glob(os.path.join(runs[0], '*.trace.json.gz'))
  with gzip.open(perfetto) as f:
    names = [e.get('name', '') for e in json.load(f)['traceEvents']]
  steps = [n for n in names if n == 'CommonPjRtLoadedExecutable::Execute (jit_train_step)']
  assert len(steps) == 2, f'{len(steps)} train steps in the trace, expected steps 2 and 3'
