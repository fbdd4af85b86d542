"""Runs one command once per bad value of each of its flags, in this process, through the
shell's parsing and error handling (tests/flag_fuzz_test.py). argv[1]: a JSON spec
{module, baseline (arguments of a run that succeeds), extra ({flag: arguments it needs}),
seconds (a case's bound), out (a path the baseline writes: removed before each case)}.
Prints one JSON object per case: flag, label, value, outcome (ok | error | hang |
escaped) and the last line of the command's message.
"""
import contextlib
import importlib
import io
import json
import os
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


if __name__ == '__main__':
  main()
