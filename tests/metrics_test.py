"""metrics.jsonl keeps each step once across resumes, even after a torn last line."""
import json

from zoo import metrics


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

