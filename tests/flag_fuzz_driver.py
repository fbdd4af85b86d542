"""Runs one command once per bad value of each of its flags, in this process, through the
shell's parsing and error handling (tests/flag_fuzz_test.py). argv[1]: a JSON spec
{module, baseline (arguments of a run that succeeds), extra ({flag: arguments it needs}),
seconds (a case's bound), out (a path the baseline writes: removed before each case)}.
Prints one JSON object per case: flag, label, value, outcome (ok | error | hang |
escaped) and the last line of the command's message.

With argv[1] == '--processes', argv[2] is {module, cases (argument lists), seconds,
parallel}: each case is `python -m MODULE ARGS` in a process of its own, forked from this
one once the module's imports are done (a fresh process's JAX runtime, without its ~2 s
of interpreter and library start-up). Prints one JSON object per case: its index, exit
status (null: no verdict within seconds, killed) and stderr.
"""
import contextlib
import importlib
import io
import json
import os
import runpy
import shutil
import signal
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # pylint: disable=wrong-import-position
from absl import logging  # pylint: disable=wrong-import-position
from zoo import shell  # pylint: disable=wrong-import-position

# Shape the JAX runtime, which starts once per process: tried in processes of their own.
DEVICE_FLAGS = {'cpu_devices', 'coordinator_address', 'num_processes', 'process_id',
                'initialization_timeout', 'heartbeat_timeout'}
SKIPPED = {'config'}  # The experiment file and its fields: tests/config_fuzz_test.py.


def bad_values(flag) -> dict:
  """What a user might type by mistake, by the flag's type."""
  if isinstance(flag, flags.BooleanFlag):
    return {'wrong type': 'abc'}
  if isinstance(flag.parser, flags.IntegerParser):
    return {'zero': '0', 'negative': '-1', 'huge': str(10**9), 'wrong type': 'abc'}
  if isinstance(flag.parser, flags.FloatParser):
    return {'zero': '0', 'negative': '-1', 'nan': 'nan', 'inf': 'inf', 'huge': '1e9',
            'wrong type': 'abc'}
  if isinstance(flag.parser, flags.EnumParser):
    return {'unknown string': 'no-such-value'}
  return {'unknown string': 'no-such-value', 'empty': ''}


class _Hang(BaseException):  # Not an Exception: the shell must not turn it into a line.
  pass


def _alarm(signum, frame):
  raise _Hang()


def run_case(command, argv, seconds):
  """(outcome, last line of the message) of `command` run on `argv` by the shell."""
  flags.FLAGS.unparse_flags()
  previous = signal.signal(signal.SIGALRM, _alarm)
  signal.alarm(seconds)
  try:
    with contextlib.redirect_stdout(io.StringIO()):
      shell._main(command, shell._parse(argv))  # pylint: disable=protected-access
  except SystemExit as e:
    if e.code in (None, 0):
      return 'ok', ''
    message = str(e.code)
    return 'error', message.strip().splitlines()[-1] if message.strip() else message
  except _Hang:
    return 'hang', f'no verdict in {seconds} s'
  except BaseException as e:  # pylint: disable=broad-except
    return 'escaped', f'{type(e).__name__}: {e}'
  finally:
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)
  return 'ok', ''


def main():
  spec = json.loads(sys.argv[1])
  os.chdir(tempfile.mkdtemp(prefix='zoo-flag-fuzz-'))  # Relative paths a case writes land here.
  shell._exit_within = lambda code: None  # pylint: disable=protected-access  # (This process goes on.)
  shell._abort = sys.exit  # pylint: disable=protected-access
  shell.define_flags()
  module = importlib.import_module(spec['module'])
  if hasattr(module, 'define_flags'):
    module.define_flags()
  logging.set_verbosity(logging.WARNING)
  prog = spec['module']
  for flag in flags.FLAGS.get_flags_for_module(module) + flags.FLAGS.get_flags_for_module(shell):
    if flag.name in SKIPPED:
      continue
    for label, value in bad_values(flag).items():
      if flag.name in DEVICE_FLAGS and label != 'wrong type':
        continue  # (A wrong type is refused by the parser, before the runtime starts.)
      shutil.rmtree(spec['out'], ignore_errors=True)
      argv = [prog, *spec['baseline'], *spec['extra'].get(flag.name, []), f'--{flag.name}={value}']
      t0 = time.monotonic()
      outcome, line = run_case(module.main, argv, spec['seconds'])
      print(json.dumps({'flag': flag.name, 'label': label, 'value': value, 'outcome': outcome,
                        'line': line, 'seconds': round(time.monotonic() - t0, 1)}), flush=True)
  # The baseline itself must succeed, or every case above proves nothing.
  shutil.rmtree(spec['out'], ignore_errors=True)
  outcome, line = run_case(module.main, [prog, *spec['baseline']], spec['seconds'])
  print(json.dumps({'flag': '', 'label': 'baseline', 'value': '', 'outcome': outcome,
                    'line': line, 'seconds': 0}), flush=True)


def fork_cases(spec):
  """Runs each case of `spec` in a forked process, `parallel` at a time; in the parent,
  prints the verdicts and returns None; in a child, returns (module, args, stderr path)."""
  importlib.import_module(spec['module'])  # Its imports, once (its flags: in each child).
  import threading  # pylint: disable=import-outside-toplevel
  assert threading.active_count() == 1, 'a thread before fork'
  import jax._src.xla_bridge as xb  # pylint: disable=import-outside-toplevel
  assert not xb._backends, 'the JAX runtime started before fork'  # pylint: disable=protected-access
  folder = tempfile.mkdtemp(prefix='zoo-flag-fuzz-')
  pending, running, verdicts = list(enumerate(spec['cases'])), {}, {}
  while pending or running:
    while pending and len(running) < spec['parallel']:
      index, args = pending.pop(0)
      stderr = os.path.join(folder, f'{index}.stderr')
      sys.stdout.flush()
      sys.stderr.flush()
      pid = os.fork()
      if pid == 0:
        return spec['module'], args, stderr
      running[pid] = (index, stderr, time.monotonic() + spec['seconds'])
    pid, status = os.waitpid(-1, os.WNOHANG)
    if pid:
      index, stderr, _ = running.pop(pid)
      verdicts[index] = (os.waitstatus_to_exitcode(status), stderr)
      continue
    for pid, (index, stderr, deadline) in list(running.items()):
      if time.monotonic() > deadline:  # No verdict in time: killed, reported as such.
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        running.pop(pid)
        verdicts[index] = (None, stderr)
    time.sleep(0.05)
  for index in sorted(verdicts):
    code, stderr = verdicts[index]
    with open(stderr, encoding='utf-8', errors='replace') as f:
      print(json.dumps({'index': index, 'returncode': code, 'stderr': f.read()}))
  shutil.rmtree(folder, ignore_errors=True)
  return None


def run_forked(module, args, stderr):
  """In the child: `python -m MODULE ARGS` with stdout discarded and stderr to a file."""
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, 1)
  os.dup2(os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
  sys.argv = [module, *args]
  del sys.modules[module]  # Its code runs afresh as __main__, on the imports already made.
  runpy.run_module(module, run_name='__main__', alter_sys=True)  # Exits as the command does.


if __name__ == '__main__':
  if sys.argv[1] == '--processes':
    child = fork_cases(json.loads(sys.argv[2]))
    if child:
      run_forked(*child)
  else:
    main()
