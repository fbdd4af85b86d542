"""What a run writes for people: metrics.jsonl, TensorBoard events, JSON files, the console."""
import atexit
import html
import json
import logging as std_logging
import os
import queue
import sys
import sysconfig
import threading
import uuid
import warnings
from typing import Any, Callable, Optional

from absl import logging

from zoo.errors import ZooError, first_line
from zoo.store import storage

_ZOO_DIR = os.path.dirname(os.path.abspath(__file__))
_STDLIB = sysconfig.get_paths()['stdlib']
CLOSE_SECONDS = 10.0  # The longest a metrics writer (TensorBoard, W&B) may take to close.
_THREAD_FAULTS: list = []  # Errors that ended a writer thread (zoo's or a library's).
_OPEN: list = []  # The MetricWriters open now: a writer thread failing after theirs closed is quiet.


def _record_thread_faults() -> None:
  """A library writer thread that dies (tensorboardX's event writer on a full disk) would
  print a traceback and leave the run writing into a void: its error is kept instead, shown
  as one warning line, and raised by the next MetricWriter.write."""
  if getattr(threading.excepthook, 'zoo', False):
    return
  previous = threading.excepthook
  def hook(args):
    writer = type(args.thread).__name__ == '_EventLoggerThread' or (
        args.thread is not None and args.thread.name.startswith('zoo-'))
    if not (writer and isinstance(args.exc_value, OSError)):
      previous(args)
      return
    if _OPEN:  # Once the run's writers are closed (abandoned), its end was already reported.
      _THREAD_FAULTS.append(args.exc_value)
      logging.warning('writer thread %s stopped: %s', type(args.thread).__name__, args.exc_value)
  hook.zoo = True
  threading.excepthook = hook
  previous_unraisable = sys.unraisablehook
  def unraisable(args):
    # tensorboardX's bucket writer flushes again from __del__ at exit and prints a
    # traceback when the bucket refuses: the run has ended with that error already.
    owner = getattr(args.object, '__module__', None) or type(args.object).__module__
    if not (owner or '').startswith('tensorboardX') or _OPEN:
      previous_unraisable(args)
  sys.unraisablehook = unraisable


def bounded(close: Callable[[], None], what: str, seconds: Optional[float] = None) -> None:
  """Runs `close()` and waits for it at most `seconds`: a writer that cannot finish (its
  storage full or gone, its server unreachable) is abandoned with a warning, never waited
  on for good. Its error, if it ends in time with one, is raised here."""
  seconds = CLOSE_SECONDS if seconds is None else seconds
  errors = []
  def run():
    try:
      close()
    except BaseException as e:  # pylint: disable=broad-except  # Raised on the caller's thread.
      errors.append(e)
  thread = threading.Thread(target=run, name=f'zoo-close-{what}', daemon=True)
  thread.start()
  thread.join(seconds)
  if thread.is_alive():
    logging.warning('%s did not close within %.0f s: abandoned (its last rows may be missing)',
                    what, seconds)
  elif errors:
    raise errors[0]


class _OffThread:
  """A writer whose calls run on a thread of their own, in order: a library writer that
  blocks (tensorboardX's, once its thread died on a full disk, blocks every later call and
  its close for good) never blocks the run. An error it raises comes back from the next
  call; close() waits at most CLOSE_SECONDS."""

  def __init__(self, writer: Any, name: str):
    self._writer, self._name, self._calls = writer, name, queue.SimpleQueue()
    self._thread = threading.Thread(target=self._serve, name=f'zoo-{name}', daemon=True)
    self._thread.start()

  def _serve(self) -> None:
    while (call := self._calls.get()) is not None:
      method, args, kwargs = call
      try:
        getattr(self._writer, method)(*args, **kwargs)
      except Exception as e:  # pylint: disable=broad-except  # Raised by the next call.
        _THREAD_FAULTS.append(e)
        return

  def __call__(self, method: str, *args, **kwargs) -> None:
    self._calls.put((method, args, kwargs))

  def close(self) -> None:
    self._calls.put(None)
    bounded(lambda: (self._thread.join(), self._writer.close()), self._name)


def _without_exit_hooks(make: Callable[[], Any]) -> Any:
  """Returns make()'s writer without the exit hooks it registers. tensorboardX registers its
  writer's close to run at interpreter exit; once its thread died (a full disk) that close
  waits for good, so the process would never exit. zoo closes the writer itself, bounded."""
  register = atexit.register
  atexit.register = lambda hook, *args, **kwargs: hook
  try:
    return make()
  finally:
    atexit.register = register


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
    self._workdir = workdir
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
      _record_thread_faults()
      _THREAD_FAULTS.clear()  # This run's faults only.
      self._tb = _OffThread(_without_exit_hooks(lambda: summary_writer(
          logdir=workdir, flush_secs=10, purge_step=start_step + 1)), 'TensorBoard events')
      if self._wandb:
        self._wandb.start(logged)
      _OPEN.append(self)

  def write(self, step: int, scalars: dict) -> None:
    if not self._active:
      return
    if _THREAD_FAULTS:  # A writer thread died: the run ends with its error.
      raise self._fault(_THREAD_FAULTS[0])
    row = {'step': int(step), **{k: float(v) for k, v in scalars.items()}}
    try:
      if self._jsonl:
        self._jsonl.write(json.dumps(row) + '\n')
        self._jsonl.flush()
      else:
        self._rows.append(json.dumps(row) + '\n')
        storage.write_text(self._path, ''.join(self._rows))
    except OSError as e:
      raise storage.named(e, self._path) from None
    for name, value in row.items():
      if name != 'step':
        self._tb('add_scalar', name, value, global_step=row['step'])
    if self._wandb:
      self._wandb.write(row['step'], {k: v for k, v in row.items() if k != 'step'})

  def _fault(self, error: Exception) -> Exception:
    """A writer thread's error, naming where it wrote: a storage error with the path; a
    bucket's refusal (tensorboardX writes buckets with google-cloud-storage) as one line."""
    where = f'{self._workdir} (TensorBoard events)'
    if isinstance(error, OSError):
      return storage.named(error, where)
    first = first_line(error)
    return ZooError(f'{where}: {type(error).__name__}: {first}; check the credentials, '
                    'permissions and network, then run the same command again')

  def sync(self) -> None:
    """Makes the rows written so far durable (fsync): called before each checkpoint, so a
    disk that fails keeps every row up to the step a restart resumes from."""
    if self._active and self._jsonl:
      try:
        os.fsync(self._jsonl.fileno())
      except OSError as e:
        raise storage.named(e, self._path) from None

  def text(self, step: int, name: str, text: str) -> None:
    if self._active:
      self._tb('add_text', name, text, global_step=int(step))
      if self._wandb:
        self._wandb.text(int(step), name, text)

  def _named_close(self, close: Callable[[], None]) -> None:
    try:
      close()
    except OSError as e:
      raise storage.named(e, self._workdir) from None
    except ZooError:
      raise
    except Exception as e:  # pylint: disable=broad-except  # A bucket refusing TensorBoard's flush.
      raise self._fault(e) from None

  def close(self) -> None:
    """Closes every writer, each within CLOSE_SECONDS; the first error is raised after."""
    if not self._active:
      return
    if self in _OPEN:
      _OPEN.remove(self)
    closers = [self._tb.close] + ([self._jsonl.close] if self._jsonl else [])
    closers = [lambda c=c: self._named_close(c) for c in closers]
    closers += [lambda: bounded(self._wandb.close, 'W&B')] if self._wandb else []
    errors = []
    for close in closers:
      try:
        close()
      except Exception as e:  # pylint: disable=broad-except  # Close the others first.
        errors.append(e)
    errors += [self._fault(e) for e in _THREAD_FAULTS]
    if errors:  # A writer that died after the last row still fails the run.
      raise errors[0]


class WandbWriter:
  """Rows, the config and the LM samples of a run in Weights & Biases (process 0 only).

  The run's W&B id is kept in `workdir/wandb_run.json`, so a resumed run continues the same
  W&B run. W&B keeps what it was sent and takes steps only in increasing order, so a resumed
  run sends only steps beyond the last one its predecessor logged (the rows in between are
  the same numbers: batches and randomness are functions of (seed, step)). `mode` is W&B's
  own: 'online', 'offline' (synced later with `wandb sync`) or 'disabled'; '' takes W&B's
  WANDB_MODE (else online). WANDB_DIR, if set, is where W&B keeps its files (else the
  workdir, when it is local).
  """

  def __init__(self, workdir: str, project: str, config: dict, mode: str = '',
               entity: str = ''):
    self.workdir, self.project, self.config = workdir, project, config
    self.mode = wandb_mode(mode)
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
      storage.write_text(id_file, json.dumps({'id': run_id, 'project': self.project}, indent=2))
    local = not storage.is_remote(self.workdir) and not os.environ.get('WANDB_DIR')
    try:
      self.run = wandb.init(project=self.project, entity=self.entity, id=run_id,
                            resume='allow', dir=self.workdir if local else None, mode=self.mode,
                            config=self.config, settings=wandb.Settings(console='off',
                                                                        silent=True))
    except (wandb.errors.Error, OSError) as e:  # No login, no network, a bad project name.
      raise ZooError(f'metrics.wandb_project: W&B refused the run: {type(e).__name__}: '
                     f'{first_line(e)}; check the login and the '
                     'project, or set WANDB_MODE=offline') from None
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


def wandb_mode(mode: str = '') -> str:
  """The W&B mode a run uses: the config's, else W&B's own WANDB_MODE, else online."""
  return mode or os.environ.get('WANDB_MODE') or 'online'


def wandb_logged_in(mode: str = '') -> bool:
  """Whether W&B would find credentials without asking (an online run needs them): W&B's
  documented places, WANDB_API_KEY, WANDB_IDENTITY_TOKEN_FILE, or the netrc entry that
  `wandb login` writes for its host (WANDB_BASE_URL)."""
  if wandb_mode(mode) != 'online' or os.environ.get('WANDB_API_KEY') or os.environ.get(
      'WANDB_IDENTITY_TOKEN_FILE'):
    return True
  import netrc  # pylint: disable=import-outside-toplevel
  import urllib.parse  # pylint: disable=import-outside-toplevel
  host = urllib.parse.urlparse(os.environ.get('WANDB_BASE_URL') or 'https://api.wandb.ai').hostname
  path = os.environ.get('NETRC') or os.path.expanduser('~/.netrc')
  try:
    return bool(host) and netrc.netrc(path).authenticators(host) is not None
  except (OSError, netrc.NetrcParseError):
    return False


def tracker(config: Any, workdir: str) -> Optional[WandbWriter]:
  """The run's W&B writer if config.metrics names a project, else None."""
  m = config.metrics
  if not m.wandb_project:
    return None
  return WandbWriter(workdir, m.wandb_project, json.loads(config.to_json_best_effort()),
                     m.wandb_mode, m.wandb_entity)


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
