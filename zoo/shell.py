"""The shell every zoo command runs in: its flags, the console, the devices and the
processes, and how it ends.

A command is a function of its arguments (`python -m zoo.X ARGS`), run by `run`:
- shared flags: --cpu_devices, the multi-process trio (--coordinator_address,
  --num_processes, --process_id) and its timeouts, --log_libraries;
- the console keeps zoo's lines and every warning, not libraries' INFO lines;
- the devices and the job: emulated CPU devices, or JAX's multi-process runtime (joined
  before any other JAX work), or one CPU device per core where there is no accelerator;
- every expected failure (a ZooError, a storage fault) ends as one `zoo: error: ...`
  line and exit 1; with several processes it exits at once, so its peers end within the
  heartbeat timeout instead of waiting for it at shutdown. A traceback is printed only for
  what zoo did not expect: a bug. `--help` prints the flags and exits 0.
"""
import errno
import gc
import os
import sys
import threading
import time
from typing import Callable, NoReturn, Optional

from absl import app
from absl import flags
from absl import logging

from zoo import errors
from zoo.errors import ZooError

FLAGS = flags.FLAGS
HELP = ('--help', '-h', '--helpshort', '-?', '--helpfull')


def define_flags(devices: bool = True) -> None:
  """The flags every command shares; `devices`: the command uses JAX's devices."""
  flags.DEFINE_bool('log_libraries', False, "Also show installed libraries' INFO lines "
                    "(orbax's per-save messages, ...); by default the console has zoo's lines "
                    'and every warning.')
  if not devices:
    return
  flags.DEFINE_integer('cpu_devices', None, 'Run on this many emulated CPU devices (try a mesh '
                       'without accelerators). Default on a host without accelerators: one per '
                       'core (a power of two) to train (zoo.main), one to sample, convert or '
                       'evaluate.')
  flags.DEFINE_string('coordinator_address', None,
                      'host:port of process 0, for a multi-process job.')
  flags.DEFINE_integer('num_processes', None, 'Processes in the job.')
  flags.DEFINE_integer('process_id', None, 'This process, in [0, num_processes).')
  flags.DEFINE_integer('initialization_timeout', 300,
                       'Seconds to wait for every process to join.')
  flags.DEFINE_integer('heartbeat_timeout', 60, 'Seconds of silence after which a process '
                       'counts as dead and the others exit.')


_STARTED = []  # Set once the devices are up: only then may fail() ask JAX about peers.


def start_devices(platforms: Optional[str] = None, per_core: bool = True) -> None:
  """Sets up the devices and joins the job (see zoo.parallel.distributed); `per_core`: a host
  without accelerators gets one CPU device per core (training), else one."""
  import jax  # pylint: disable=import-outside-toplevel
  from zoo.parallel import distributed  # pylint: disable=import-outside-toplevel
  if platforms:
    jax.config.update('jax_platforms', platforms)
  per_core = distributed.initialize(
      FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id, FLAGS.cpu_devices,
      FLAGS.initialization_timeout, FLAGS.heartbeat_timeout, per_core=per_core)
  _STARTED.append(True)
  if per_core and jax.default_backend() == 'cpu':
    logging.info('no accelerator: %d CPU devices, one per core (--cpu_devices=N to choose)',
                 jax.local_device_count())
  logging.info('JAX %s, process %d of %d, %d local / %d global devices: %s', jax.__version__,
               jax.process_index(), jax.process_count(), jax.local_device_count(),
               jax.device_count(), jax.devices())


def fail(message: str) -> NoReturn:
  """Exits 1 with `message` as the last line. Once the devices are up, at once: the command's
  own cleanup has run by then, and what is left of Python's exit could print after the line
  (a dead writer's multiprocessing queue finalizer does) or wait: with peers, at JAX's
  shutdown barrier, where a process failing alone would hang the job; its death instead
  ends every peer within --heartbeat_timeout."""
  if _STARTED:
    _abort(message)
  _exit_within(1)
  sys.exit(message)


_abort = errors.abort  # (The flag fuzz driver, which goes on running cases, replaces it.)


EXIT_SECONDS = 10.0  # The most Python's own exit may take once the command has ended.


def _exit_within(code: int) -> None:
  """Ends the process with `code` if Python's exit (joining threads, running exit hooks) has
  not within EXIT_SECONDS: a library's thread stuck on storage that failed (a writer blocked
  on a read-only disk) must not keep an ended command alive."""
  def end():
    time.sleep(EXIT_SECONDS)
    if code == 0:  # (A failure's line stays the last.)
      stuck = [t.name for t in threading.enumerate() if not t.daemon and t.name != 'MainThread']
      sys.stderr.write(f'zoo: warning: exiting without waiting for threads that did not end '
                       f'within {EXIT_SECONDS:.0f} s: {", ".join(stuck) or "exit hooks"}\n')
      sys.stderr.flush()
    os._exit(code)  # pylint: disable=protected-access
  threading.Thread(target=end, name='zoo-exit', daemon=True).start()


def storage_fault(e: OSError) -> str:
  """A storage error as the rest of one line: the path, the cause and what to do."""
  where = e.filename or 'the workdir'
  hint = {errno.ENOSPC: 'free space', errno.EDQUOT: 'free space (quota)',
          errno.EROFS: 'make the storage writable', errno.EACCES: 'fix its permissions'}.get(
              e.errno, 'fix the storage')
  cause = e.strerror or errors.first_line(e, type(e).__name__)
  return f'{where}: {cause}; {hint}, then run the same command again'


def _is_bucket_error(e: Exception) -> bool:
  """gcsfs's and google-auth's errors (an HTTP 5xx after retries, refused credentials)."""
  return type(e).__module__.split('.')[0] in ('gcsfs', 'google', 'fsspec')


def _is_peer_lost(e: Exception) -> bool:
  """A collective over the processes' TCP links (XLA:CPU's gloo) that failed mid-step: a
  peer died or its connection broke while this process was exchanging with it. (Between
  steps, and on TPUs and GPUs, a dead peer is found by the heartbeat instead.)"""
  message = str(e)
  return type(e).__name__ == 'JaxRuntimeError' and 'Gloo ' in message and ' failed: ' in message


def _main(command: Callable[[list[str]], None], argv: list[str]) -> None:
  from zoo.store import metrics  # pylint: disable=import-outside-toplevel
  if not FLAGS.log_libraries:
    metrics.quiet_libraries()
  try:
    command(argv)
    _exit_within(0)
  except ZooError as e:
    fail(f'zoo: error: {e}')
  except BrokenPipeError:  # Output piped into a reader that stopped (`| head`): not a fault.
    sys.stderr.close()
    os._exit(0)  # pylint: disable=protected-access
  except OSError as e:  # Storage: a full disk, a read-only or vanished path, a quota.
    fail(f'zoo: error: {storage_fault(e)}')
  except KeyboardInterrupt:
    fail('zoo: error: interrupted')
  except Exception as e:  # pylint: disable=broad-except
    if _is_bucket_error(e):
      fail(f'zoo: error: the bucket refused a request: {type(e).__name__}: '
           f'{errors.first_line(e)}; check the credentials, permissions and '
           'network, then run the same command again')
    if _is_peer_lost(e):
      fail(f'zoo: error: a collective with the other processes failed ({errors.first_line(e)}): '
           'a peer process died or its connection broke; start every process again to '
           'resume from the newest checkpoint')
    logging.exception('zoo: unexpected error')
    fail('zoo: error: unexpected error (a bug in zoo: the traceback above says where; please '
         'report it)')


def run(command: Callable[[list[str]], None]) -> NoReturn:
  """Runs `command(argv)` (argv: the program and its positional arguments) in the shell."""
  # What the imports made (JAX, Flax, orbax: 140,000 objects the collector tracks) lives as
  # long as the process. Frozen, it is skipped by Python's full collections during the
  # command (tracing triggers many) and by the last one at exit: a char_lm smoke run in
  # 3.5 CPU-s instead of 4.3, a command that fails at once in 0.2 s less.
  gc.freeze()
  if any(arg in HELP for arg in sys.argv[1:]):  # absl's own --help exits 1.
    module = sys.modules['__main__']
    print((module.__doc__ or '').strip() + '\n')
    if '--helpfull' in sys.argv:
      print(FLAGS)
    else:  # The command's own flags, then the shell's.
      print('\n\n'.join(h for h in (FLAGS.module_help(module), FLAGS.module_help(__name__)) if h))
    sys.exit(0)
  try:
    app.run(lambda argv: _main(command, argv), flags_parser=_parse)
  except SystemExit:
    raise
  sys.exit(0)


def _parse(argv: list[str]) -> list[str]:
  """absl's flag parsing, with a bad flag value or experiment file as one line."""
  try:
    rest = FLAGS(argv)
  except Exception as e:  # pylint: disable=broad-except  # absl's and ml_collections' errors.
    fail(f'zoo: error: {_flag_error(e, argv)}')
  for name, flag in FLAGS._flags().items():  # pylint: disable=protected-access
    if flag.present and flag.default is None and flag.value in ('', ['']):
      fail(f'zoo: error: --{name} is empty; give a value, or leave the flag out')
  return rest


def _unknown_field(config, dotted: str) -> Optional[str]:
  """One line if `config` has no field `dotted` (a --config.a.b override), else None."""
  import ml_collections  # pylint: disable=import-outside-toplevel
  node, parent = config, 'config'
  for key in dotted.split('.'):
    if not isinstance(node, (ml_collections.ConfigDict, dict)):
      return None
    if key not in node:
      return (f'--config.{dotted}: {parent} has no field {key!r}; its fields: '
              f'{", ".join(sorted(node.keys()))}')
    node, parent = node[key], f'{parent}.{key}'
  return None


def _flag_error(e: Exception, argv: list[str]) -> str:
  """One line for a parsing error. ml_collections reports an experiment file that fails to
  load as a multi-line dump without its cause: the file is loaded again to name it."""
  config = next((a.split('=', 1)[1] for a in argv[1:] if a.startswith('--config=')), None)
  if config:
    from zoo.run.config import load_experiment  # pylint: disable=import-outside-toplevel
    path, _, arg = config.partition(':')
    try:
      loaded = load_experiment(path, arg or None)
    except ZooError as error:
      return str(error)
    except Exception:  # pylint: disable=broad-except  # Named by the first line below.
      loaded = None
    for override in (a.split('=', 1)[0][len('--config.'):] for a in argv[1:]
                     if a.startswith('--config.')):
      if (unknown := _unknown_field(loaded, override)) is not None:
        return unknown
  text = errors.first_line(e, type(e).__name__)
  if isinstance(e, KeyError) and len(text) > 1 and text[0] == text[-1] == "'":
    text = text[1:-1]  # A KeyError's message is the repr of its key.
  if isinstance(e, flags.Error):
    return text
  return f'--config override: {text} ({type(e).__name__})'
