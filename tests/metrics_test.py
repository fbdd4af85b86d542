"""metrics.jsonl keeps each step once across resumes, even after a torn last line."""
import json

from zoo.store import metrics


def test_resume_drops_rows_past_the_start_step_and_torn_lines(tmp_path):
  path = tmp_path / 'metrics.jsonl'
  rows = [{'step': s, 'train/loss': 1.0 / s} for s in (1, 2, 3, 4)]
  path.write_text(''.join(json.dumps(r) + '\n' for r in rows) + '{"step": 5, "train/lo')
  writer = metrics.MetricWriter(str(tmp_path), active=True, start_step=2)
  writer.write(3, {'train/loss': 0.25})
  writer.close()
  steps = [json.loads(line)['step'] for line in path.read_text().splitlines()]
  assert steps == [1, 2, 3]


def test_inactive_writer_writes_nothing(tmp_path):
  writer = metrics.MetricWriter(str(tmp_path), active=False, start_step=0)
  writer.write(1, {'train/loss': 1.0})
  writer.close()
  assert not list(tmp_path.iterdir())


def test_format_duration():
  assert [metrics.format_duration(s) for s in (5, 65, 3725)] == ['5s', '1m05s', '1h02m05s']



_DEAD_WRITER = r"""
import errno, json, sys, threading, time
from tensorboardX import record_writer
from zoo.store import metrics

def full_disk(self, data):
  raise OSError(errno.ENOSPC, 'No space left on device')
metrics.CLOSE_SECONDS = 2.0
writer = metrics.MetricWriter(sys.argv[1], active=True, start_step=0)
record_writer.RecordWriter.write = full_disk  # The disk fills up.
outcome = {}
def log_then_close():
  try:
    for step in range(1, 200):  # A row of 20 scalars: more events than its queue holds.
      writer.write(step, {f'train/x{i}': 1.0 for i in range(20)})
      time.sleep(0.01)
  except OSError as e:
    outcome['errno'], outcome['filename'] = e.errno, e.filename
  t0 = time.monotonic()
  try:
    writer.close()
  except OSError:
    pass
  outcome['close_s'] = time.monotonic() - t0
thread = threading.Thread(target=log_then_close, daemon=True)
thread.start()
thread.join(30)
outcome['blocked'] = thread.is_alive()
print(json.dumps(outcome))
"""


def test_a_dead_tensorboard_writer_ends_the_run_with_its_error_and_closes_in_bounded_time(
    tmp_path):
  """tensorboardX's event thread dies on a full disk; from then on each of its calls and its
  close block for good (a bounded queue whose consumer is gone), its exit-time close too.
  The writer must raise the disk's error at the next row, close within CLOSE_SECONDS, and the
  process must then exit (run apart: a hang here would otherwise hang the test session)."""
  import errno  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  import time  # pylint: disable=import-outside-toplevel

  t0 = time.monotonic()
  try:
    result = subprocess.run([sys.executable, '-c', _DEAD_WRITER, str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
  except subprocess.TimeoutExpired:
    raise AssertionError('the process did not exit after its writer was closed') from None
  assert result.returncode == 0, result.stderr[-2000:]
  outcome = json.loads(result.stdout.strip().splitlines()[-1])
  assert not outcome['blocked'], 'the writer blocked (write or close never returned)'
  assert outcome['errno'] == errno.ENOSPC
  assert str(tmp_path) in outcome['filename']
  assert outcome['close_s'] < 5
  assert time.monotonic() - t0 < 45


def test_a_tensorboard_writer_refused_at_close_names_the_workdir(tmp_path, monkeypatch):
  """A bucket that refuses TensorBoard's last flush (google-cloud-storage raises its own
  Forbidden, not an OSError) ends the run as one line naming the workdir."""
  import pytest  # pylint: disable=import-outside-toplevel
  from zoo.errors import ZooError  # pylint: disable=import-outside-toplevel

  class Forbidden(Exception):
    pass
  writer = metrics.MetricWriter(str(tmp_path), active=True, start_step=0)
  def refuse():
    raise Forbidden('403 POST .../upload/storage/v1/b/bucket/o: writes refused')
  monkeypatch.setattr(writer._tb._writer, 'close', refuse)  # pylint: disable=protected-access
  with pytest.raises(ZooError, match=f'^{tmp_path} \\(TensorBoard events\\): Forbidden: 403 '):
    writer.close()
