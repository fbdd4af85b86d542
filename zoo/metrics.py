"""What a run writes for people: metrics.jsonl, TensorBoard events, JSON files, the console."""
import html
import json
import logging as std_logging
import os
import sys
import sysconfig
import uuid
import warnings
from typing import Any, Optional

from absl import logging

from zoo import storage

_ZOO_DIR = os.path.dirname(os.path.abspath(__file__))
_STDLIB = sysconfig.get_paths()['stdlib']


def _summary_writer_class() -> Any:
  """tensorboardX.SummaryWriter, imported without torch: tensorboardX imports torch when it
  is installed, only to accept torch tensors (zoo passes floats and strings), and that costs
  each run about a second of start-up."""
  if 'torch' in sys.modules:
    from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
    return SummaryWriter
  sys.modules['torch'] = None  # `import torch` raises ImportError while this is set.
  try:
    from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
  finally:
    del sys.modules['torch']
  return SummaryWriter


class MetricWriter:
  """Writes one row per call; only the process given `active=True` writes anything.

  A run starting at `start_step` (0, or the checkpoint it resumed from) first drops the
  rows that a killed predecessor logged after that step, so each step appears once in
  metrics.jsonl and in TensorBoard. With `wandb` (a WandbWriter), rows also go to W&B.
  """

  def __init__(self, workdir: str, active: bool, start_step: int,
               wandb: Optional['WandbWriter'] = None):
    self._active = active
    self._wandb = wandb if active else None
    if active:
      summary_writer = _summary_writer_class()
      self._path = path = storage.join(workdir, 'metrics.jsonl')
      logged, kept = 0, []
      if storage.path(path).exists():
        lines = storage.read_text(path).splitlines(keepends=True)
        logged = max((s for s in map(_step_of, lines) if s != float('inf')), default=0)
        kept = [line for line in lines if _step_of(line) <= start_step]
        if not storage.is_remote(path):
          with open(path, 'w', encoding='utf-8') as f:
            f.writelines(kept)
      # A bucket object cannot be appended to: there the file is rewritten whole per row.
      self._rows = kept if storage.is_remote(path) else None
      self._jsonl = None if storage.is_remote(path) else open(path, 'a', encoding='utf-8')
      self._tb = summary_writer(logdir=workdir, flush_secs=10, purge_step=start_step + 1)
      if self._wandb:
        self._wandb.start(logged)

  def write(self, step: int, scalars: dict) -> None:
    if not self._active:
      return
    row = {'step': int(step), **{k: float(v) for k, v in scalars.items()}}
    if self._jsonl:
      self._jsonl.write(json.dumps(row) + '\n')
      self._jsonl.flush()
    else:
      self._rows.append(json.dumps(row) + '\n')
      storage.write_text(self._path, ''.join(self._rows))
    for name, value in row.items():
      if name != 'step':
        self._tb.add_scalar(name, value, global_step=row['step'])
    if self._wandb:
      self._wandb.write(row['step'], {k: v for k, v in row.items() if k != 'step'})

  def text(self, step: int, name: str, text: str) -> None:
    if self._active:
      self._tb.add_text(name, text, global_step=int(step))
      if self._wandb:
        self._wandb.text(int(step), name, text)

  def close(self) -> None:
    if self._active:
      if self._jsonl:
        self._jsonl.close()
      self._tb.close()
      if self._wandb:
        self._wandb.close()


class WandbWriter:
  """Rows, the config and the LM samples of a run in Weights & Biases (process 0 only).

  The run's W&B id is kept in `workdir/wandb_run.json`, so a resumed run continues the same
  W&B run. W&B keeps what it was sent and takes steps only in increasing order, so a resumed
  run sends only steps beyond the last one its predecessor logged (the rows in between are
  the same numbers: batches and randomness are functions of (seed, step)). `mode` is W&B's
  own: 'online', 'offline' (synced later with `wandb sync`) or 'disabled'.
  """

  def __init__(self, workdir: str, project: str, config: dict, mode: str = 'online',
               entity: str = ''):
    self.workdir, self.project, self.config, self.mode = workdir, project, config, mode
    self.entity = entity or None
    self.run, self.after = None, 0

  def start(self, logged: int) -> None:
    """Opens (or resumes) the run; rows up to step `logged` are already in it."""
    import wandb  # pylint: disable=import-outside-toplevel
    id_file = storage.join(self.workdir, 'wandb_run.json')
    if storage.path(id_file).exists():
      run_id = json.loads(storage.read_text(id_file))['id']
      self.after = logged
    else:  # W&B newly turned on: nothing was sent yet.
      run_id = uuid.uuid4().hex[:12]
      write_json(self.workdir, 'wandb_run.json', {'id': run_id, 'project': self.project})
    self.run = wandb.init(project=self.project, entity=self.entity, id=run_id, resume='allow',
                          dir=None if storage.is_remote(self.workdir) else self.workdir,
                          mode=self.mode, config=self.config,
                          settings=wandb.Settings(console='off', silent=True))
    logging.info('W&B run %s (%s, project %s)%s', run_id, self.mode, self.project,
                 f', continuing after step {self.after}' if self.after else '')

  def write(self, step: int, scalars: dict) -> None:
    if step > self.after:
      self.run.log(scalars, step=step)

  def text(self, step: int, name: str, text: str) -> None:
    if step > self.after:
      import wandb  # pylint: disable=import-outside-toplevel
      self.run.log({name: wandb.Html(f'<pre>{html.escape(text)}</pre>')}, step=step)

  def close(self) -> None:
    self.run.finish()


def tracker(config: Any, workdir: str) -> Optional[WandbWriter]:
  """The run's W&B writer if config.metrics names a project, else None."""
  m = config.metrics
  if not m.wandb_project:
    return None
  return WandbWriter(workdir, m.wandb_project, json.loads(config.to_json_best_effort()),
                     m.wandb_mode, m.wandb_entity)


def write_json(workdir: str, name: str, obj: Any) -> None:
  """workdir/name: `obj` as indented JSON, or a string already in JSON."""
  storage.write_text(storage.join(workdir, name),
                     obj if isinstance(obj, str) else json.dumps(obj, indent=2))


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


class _ZooLinesOnly(std_logging.Filter):
  """Passes zoo's lines and users' own scripts' lines, and the first line of libraries'
  (installed or the standard library's) warnings and errors; drops libraries' INFO lines
  (orbax's per-save messages, grain, jax) and asyncio's."""

  def filter(self, record: std_logging.LogRecord) -> bool:
    path = record.pathname
    if path.startswith(_ZOO_DIR) or not (path.startswith(_STDLIB) or any(
        d in path for d in ('site-packages', 'dist-packages'))):
      return True
    if record.levelno < std_logging.WARNING or record.name == 'asyncio':
      return False  # asyncio: orbax's event loop ('Task exception was never retrieved', ...).
    record.msg, record.args = (record.getMessage().splitlines() or [''])[0], None
    record.exc_info, record.exc_text = None, None  # One line; zoo's own error says the rest.
    return True


def _closed_loop(error: BaseException) -> bool:
  return isinstance(error, RuntimeError) and str(error) == 'Event loop is closed'


def _drop_closed_loop_errors() -> None:
  """After a failed save, tensorstore completes writes whose Python callbacks find orbax's
  asyncio loop closed; each prints a bare 'RuntimeError: Event loop is closed' traceback
  (through sys.unraisablehook or sys.excepthook). Drops those; everything else is printed."""
  excepthook, unraisablehook = sys.excepthook, sys.unraisablehook
  sys.excepthook = lambda kind, value, tb: None if _closed_loop(value) else excepthook(
      kind, value, tb)
  sys.unraisablehook = lambda u: None if _closed_loop(u.exc_value) else unraisablehook(u)


def quiet_libraries() -> None:
  """Keeps the console to zoo's lines (progress, evals, samples, saves) and warnings."""
  logging.get_absl_handler().addFilter(_ZooLinesOnly())
  _drop_closed_loop_errors()
  # After a failed save, orbax's abandoned coroutines warn at exit, after zoo's error line.
  warnings.filterwarnings('ignore', message='coroutine .* was never awaited',
                          category=RuntimeWarning)
