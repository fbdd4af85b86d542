"""What a run writes for people: metrics.jsonl, TensorBoard events, JSON files, the console."""
import json
import os
from typing import Any

from absl import logging


class MetricWriter:
  """Writes one row per call; only the process given `active=True` writes anything.

  A run starting at `start_step` (0, or the checkpoint it resumed from) first drops the
  rows that a killed predecessor logged after that step, so each step appears once in
  metrics.jsonl and in TensorBoard.
  """

  def __init__(self, workdir: str, active: bool, start_step: int):
    self._active = active
    if active:
      from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
      path = os.path.join(workdir, 'metrics.jsonl')
      if os.path.exists(path):
        with open(path, encoding='utf-8') as f:
          rows = [line for line in f if _step_of(line) <= start_step]
        with open(path, 'w', encoding='utf-8') as f:
          f.writelines(rows)
      self._jsonl = open(path, 'a', encoding='utf-8')
      self._tb = SummaryWriter(logdir=workdir, flush_secs=10, purge_step=start_step + 1)

  def write(self, step: int, scalars: dict) -> None:
    if not self._active:
      return
    row = {'step': int(step), **{k: float(v) for k, v in scalars.items()}}
    self._jsonl.write(json.dumps(row) + '\n')
    self._jsonl.flush()
    for name, value in row.items():
      if name != 'step':
        self._tb.add_scalar(name, value, global_step=row['step'])

  def text(self, step: int, name: str, text: str) -> None:
    if self._active:
      self._tb.add_text(name, text, global_step=int(step))

  def close(self) -> None:
    if self._active:
      self._jsonl.close()
      self._tb.close()


def write_json(workdir: str, name: str, obj: Any) -> None:
  """workdir/name: `obj` as indented JSON, or a string already in JSON."""
  with open(os.path.join(workdir, name), 'w', encoding='utf-8') as f:
    f.write(obj if isinstance(obj, str) else json.dumps(obj, indent=2))


def _step_of(line):
  """A row's step; a line that a kill cut short counts as past every step (dropped)."""
  try:
    return json.loads(line)['step']
  except (ValueError, KeyError, TypeError):
    return float('inf')


def format_duration(seconds: float) -> str:
  seconds = int(round(seconds))
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f'{h}h{m:02d}m{s:02d}s' if h else f'{m}m{s:02d}s' if m else f'{s}s'


def log_progress(step: int, total_steps: int, scalars: dict, seconds_left: float) -> None:
  """The console line: step, loss, throughput, MFU, ETA."""
  extra = ''
  if 'perf/tokens_per_s' in scalars:
    extra += f'  {scalars["perf/tokens_per_s"]:.0f} tokens/s'
  if 'perf/mfu' in scalars:
    extra += f'  MFU {100 * scalars["perf/mfu"]:.1f}%'
  logging.info('step %d/%d  loss %.4f  %.4f s/step  %.1f examples/s%s  ETA %s',
               step, total_steps, scalars['train/loss'], scalars['perf/step_time_s'],
               scalars['perf/examples_per_s'], extra, format_duration(seconds_left))
