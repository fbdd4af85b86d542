"""What the writers wrote, read back by their own readers: W&B's offline run files (its
protobuf records) and TensorBoard's event accumulator, across a resume."""
import glob
import json
import os
import shutil
import struct

import pytest

from conftest import experiment, load_config, read_metrics, run_cli
from zoo.errors import ConfigError
from zoo.run import train

FLAGS = {'train.log_every_steps': 1, 'eval.every_steps': 4, 'checkpoint.every_steps': 2,
         'metrics.wandb_project': 'zoo-test', 'metrics.wandb_mode': 'offline'}


def _wandb_records(path):
  """The protobuf Records of a .wandb file: W&B's LevelDB-style log of 32 KiB blocks, each
  record in chunks behind a 7-byte header (crc, length, type: 1 full, 2 first, 3 middle,
  4 last), after a 7-byte file header."""
  from wandb.proto import wandb_internal_pb2  # pylint: disable=import-outside-toplevel
  with open(path, 'rb') as f:
    data = f.read()
  ident, magic, _ = struct.unpack('<4sHB', data[:7])
  assert ident == b':W&B' and magic == 0xBEE1
  pos, parts = 7, b''
  while pos + 7 <= len(data):
    left = 32768 - pos % 32768
    _, length, kind = struct.unpack('<IHB', data[pos:pos + 7])
    if left < 7 or (kind == 0 and length == 0):  # Block padding.
      pos += left
      continue
    parts += data[pos + 7:pos + 7 + length]
    pos += 7 + length
    if kind in (1, 4):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(parts)
      parts = b''
      yield record


def _wandb_runs(workdir):
  """[(run id, config, {step: {key: value}})] of each offline W&B session, oldest first."""
  runs = []
  for path in sorted(glob.glob(os.path.join(workdir, 'wandb', 'offline-run-*', 'run-*.wandb'))):
    run_id, config, history = None, {}, {}
    for record in _wandb_records(path):
      kind = record.WhichOneof('record_type')
      if kind == 'run':
        run_id = record.run.run_id
        config = {u.key: json.loads(u.value_json) for u in record.run.config.update}
      elif kind == 'history':
        row = {i.key or '/'.join(i.nested_key): json.loads(i.value_json)
               for i in record.history.item}
        history.setdefault(row['_step'], {}).update(row)
    runs.append((run_id, config, history))
  return runs


def _tensorboard(workdir, tag):
  from tensorboard.backend.event_processing import event_accumulator  # pylint: disable=import-outside-toplevel
  acc = event_accumulator.EventAccumulator(workdir, size_guidance={'scalars': 0, 'tensors': 0})
  acc.Reload()
  return acc, [(e.step, e.value) for e in acc.Scalars(tag)]


def test_wandb_and_tensorboard_hold_each_step_once_across_a_resume(tmp_path, devices):
  del devices
  workdir = str(tmp_path)
  train.train_and_evaluate(load_config('char_lm', **FLAGS, **{'train.steps': 6}), workdir)
  # As if killed after logging step 6 but before its save landed: resume from step 4.
  shutil.rmtree(os.path.join(workdir, 'checkpoints', '6'))
  train.train_and_evaluate(load_config('char_lm', **FLAGS, **{'train.steps': 8}), workdir)

  rows = [r for r in read_metrics(workdir) if 'train/loss' in r]
  assert [r['step'] for r in rows] == list(range(1, 9))
  losses = {r['step']: r['train/loss'] for r in rows}

  first, second = _wandb_runs(workdir)
  run_id = json.loads((tmp_path / 'wandb_run.json').read_text())['id']
  assert first[0] == second[0] == run_id  # One W&B run, continued.
  assert first[1]['train']['steps'] == 6 and second[1]['train']['steps'] == 8  # The config.
  assert sorted(first[2]) == list(range(1, 7))
  assert sorted(second[2]) == [7, 8]  # Steps 5 and 6 were already sent: not again.
  for history in (first[2], second[2]):
    for step, row in history.items():
      assert row['train/loss'] == pytest.approx(losses[step], rel=1e-6)
  assert 'eval/bits_per_char' in first[2][4] and 'eval/bits_per_char' in second[2][8]
  assert second[2][8]['eval/sample/_type'] == 'html-file'  # The LM sample.
  html = glob.glob(os.path.join(workdir, 'wandb', 'offline-run-*', 'files',
                                second[2][8]['eval/sample/path']))
  assert html and '<pre>' in open(html[0], encoding='utf-8').read()

  acc, scalars = _tensorboard(workdir, 'train/loss')
  assert [s for s, _ in scalars] == list(range(1, 9))  # The purged steps 5, 6 appear once.
  assert all(v == pytest.approx(losses[s], rel=1e-6) for s, v in scalars)
  assert {s for s, _ in _tensorboard(workdir, 'eval/bits_per_char')[1]} == {4, 8}
  assert 'eval/sample/text_summary' in acc.Tags()['tensors']


def test_wandb_settings_are_checked(tmp_path, devices):
  del devices
  with pytest.raises(ConfigError, match=r"config\.metrics\.wandb_mode: unknown mode 'loud'; "
                                        r'known: online, offline, disabled'):
    train.train_and_evaluate(load_config('mlp_digits', **{'metrics.wandb_mode': 'loud'}),
                             str(tmp_path / 'run'))
  assert not (tmp_path / 'run').exists()


def test_the_config_mode_wins_over_wandb_mode_and_an_api_key_counts_as_a_login(monkeypatch,
                                                                            tmp_path):
  """metrics.wandb_mode, when set, overrides W&B's WANDB_MODE (W&B's own precedence for an
  explicit init argument); unset, WANDB_MODE decides. WANDB_API_KEY is a login, as are
  W&B's identity token file and the netrc entry `wandb login` writes."""
  from zoo.store import metrics  # pylint: disable=import-outside-toplevel
  for name in ('WANDB_API_KEY', 'WANDB_IDENTITY_TOKEN_FILE', 'WANDB_MODE', 'WANDB_BASE_URL'):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv('NETRC', str(tmp_path / 'netrc'))
  assert metrics.wandb_mode('') == 'online' and not metrics.wandb_logged_in('')
  monkeypatch.setenv('WANDB_MODE', 'offline')
  assert metrics.wandb_mode('') == 'offline' and metrics.wandb_logged_in('')
  assert metrics.wandb_mode('online') == 'online' and not metrics.wandb_logged_in('online')
  assert metrics.wandb_mode('disabled') == 'disabled'
  monkeypatch.setenv('WANDB_API_KEY', 'x' * 40)
  assert metrics.wandb_logged_in('online')
  monkeypatch.delenv('WANDB_API_KEY')
  (tmp_path / 'netrc').write_text('machine api.wandb.ai login user password ' + 'y' * 40 + '\n')
  assert metrics.wandb_logged_in('online')
  monkeypatch.setenv('WANDB_BASE_URL', 'https://wandb.example.com')  # Another host's login.
  assert not metrics.wandb_logged_in('online')


def test_wandb_environment_is_honoured_and_no_login_is_one_line(tmp_path, devices, monkeypatch):
  """WANDB_MODE and WANDB_DIR work as W&B documents them when the config leaves the mode
  unset; an online run without credentials is refused before anything is written."""
  del devices
  for name in ('WANDB_API_KEY', 'WANDB_IDENTITY_TOKEN_FILE', 'WANDB_MODE', 'WANDB_DIR'):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv('NETRC', str(tmp_path / 'no-netrc'))
  project = {'metrics.wandb_project': 'zoo-test', 'train.steps': 2, 'eval.every_steps': 2}
  with pytest.raises(ConfigError, match=r'^config\.metrics\.wandb_project: zoo-test: W&B has no '
                                        r'login here .* set WANDB_MODE=offline'):
    train.train_and_evaluate(load_config('mlp_digits', **project), str(tmp_path / 'refused'))
  assert not (tmp_path / 'refused').exists()

  monkeypatch.setenv('WANDB_MODE', 'offline')  # W&B reads these at start: a new process.
  monkeypatch.setenv('WANDB_DIR', str(tmp_path / 'wandb_dir'))
  run = run_cli(f'--config={experiment("mlp_digits")}:smoke', f'--workdir={tmp_path / "run"}',
                *(f'--config.{k}={v}' for k, v in project.items()))
  assert run.returncode == 0, run.stderr[-2000:]
  assert glob.glob(str(tmp_path / 'wandb_dir' / 'wandb' / 'offline-run-*' / 'run-*.wandb'))
  assert not (tmp_path / 'run' / 'wandb').exists()
