"""The shell every command runs in (zoo/shell.py): --help exits 0, and what a user gets
wrong (a flag, an experiment file, a config value) is one `zoo: error:` line, exit 1,
nothing written, never a traceback."""
import subprocess
import sys

import pytest

from conftest import REPO, cli_env, experiment, run_cli

COMMANDS = {'zoo.main': '--cpu_devices', 'zoo.sample': '--cpu_devices',
            'zoo.convert': '--cpu_devices', 'zoo.prepare': 'log_libraries',
            'zoo.evaluate': '--cpu_devices'}


def _run(module, *args, timeout=120):
  env = cli_env()
  return subprocess.run([sys.executable, '-m', module, *args], env=env, cwd=REPO,
                        capture_output=True, text=True, timeout=timeout, check=False)


def _one_line_error(result):
  """The failure's last line, checked to be zoo's one-line error with no traceback."""
  assert result.returncode == 1, (result.returncode, result.stderr[-2000:])
  assert 'Traceback' not in result.stderr, result.stderr[-3000:]
  line = result.stderr.strip().splitlines()[-1]
  assert line.startswith('zoo: error: '), line
  return line


@pytest.mark.parametrize('module', sorted(COMMANDS))
def test_help_exits_zero_with_the_command_and_shared_flags(module):
  result = _run(module, '--help')
  assert result.returncode == 0, result.stderr[-2000:]
  assert COMMANDS[module] in result.stdout
  assert 'python -m ' + module in result.stdout  # The command's own docstring, first.


def _write(tmp_path, name, text):
  path = tmp_path / name
  path.write_text(text)
  return str(path)


def test_experiment_file_problems_are_one_line_naming_the_file_and_line(tmp_path):
  syntax = _write(tmp_path, 'syntax.py', 'def get_config(arg=None):\n  return 1 +\n')
  raises = _write(tmp_path, 'raises.py', 'def get_config(arg=None):\n  x = 1\n'
                  '  raise RuntimeError("no such variant " + str(arg))\n')
  none = _write(tmp_path, 'none.py', 'CONFIG = 1\n')
  cases = {
      'experiments/nope.py': ('--config: experiments/nope.py: no such experiment file; '
                              'experiments/ has bpe_lm.py, char_lm.py'),
      f'{syntax}': f'--config: {syntax}, line 2: invalid syntax; fix the file',
      f'{raises}:big': (f'--config: {raises}:big: get_config raised RuntimeError: no such '
                        'variant big (line 3)'),
      f'{none}': f'--config: {none} defines no get_config(arg)',
      'experiments/finetune_lm.py:smoke': (
          '--config: experiments/finetune_lm.py:smoke: get_config raised ValueError: smoke has '
          'no config.json: give the workdir of an imported model'),
      'experiments/char_lm.py:bogus': ("--config: experiments/char_lm.py:bogus: get_config "
                                       "raised ValueError: unknown variant 'bogus' of char_lm"),
  }
  from zoo import shell  # pylint: disable=import-outside-toplevel
  for config, expected in cases.items():  # What the shell makes of each, in this process.
    assert shell._flag_error(ValueError(), ['zoo', f'--config={config}']).startswith(expected)  # pylint: disable=protected-access
  workdir = tmp_path / 'run'  # And once through the command, end to end.
  line = _one_line_error(run_cli(f'--config={syntax}', f'--workdir={workdir}', devices=1))
  assert line == f'zoo: error: --config: {syntax}, line 2: invalid syntax; fix the file'
  assert not workdir.exists()


def test_bad_flags_are_one_line():
  smoke = f'--config={experiment("mlp_digits")}:smoke'
  cases = {('--bogus',): "Unknown command line flag 'bogus'",
           (smoke, '--config.train.steps=abc'): 'flag --config.train.steps=abc: ',
           (smoke, '--config.train.nope=1'): ("--config.train.nope: config.train has no field "
                                              "'nope'; its fields: batch_size, "),
           }
  for args, expected in cases.items():
    assert _one_line_error(run_cli(*args, devices=1)).startswith('zoo: error: ' + expected)
  for module, args, expected in (
      ('zoo.convert', ['sideways', '--hf_dir=x', '--workdir=y'], 'give import or export'),
      ('zoo.prepare', ['--output=x'], 'give one kind, text or images'),
      ('zoo.sample', ['--workdir=/nonexistent'], '--workdir: /nonexistent is not a directory')):
    assert _one_line_error(_run(module, *args)).startswith('zoo: error: ' + expected)


@pytest.mark.parametrize('override,field', [
    ('model.max_len=1000000000', 'config.model.max_len: the train state needs '),
])  # Other fields and values: config_fuzz_test.py, in-process.
def test_values_too_big_for_memory_are_refused_before_anything_is_allocated(tmp_path, override,
                                                                            field):
  """A typo's value would have allocated for minutes (or died of memory): refused in
  seconds, naming the field, the workdir untouched."""
  workdir = tmp_path / 'run'
  result = run_cli(f'--config={experiment("char_lm")}:smoke', f'--workdir={workdir}',
                   f'--config.{override}', devices=2, timeout=60)
  assert _one_line_error(result).startswith('zoo: error: ' + field)
  assert not workdir.exists()


_STUCK = """
import sys, threading
sys.path.insert(0, {repo!r})
from zoo import shell
from zoo.errors import ZooError
shell.EXIT_SECONDS = 1.0
def command(argv):
  threading.Thread(target=threading.Event().wait).start()  # Never ends, and is not a daemon.
  if {fail}:
    raise ZooError('--workdir: it failed')
shell.define_flags(devices=False)
shell.run(command)
"""


@pytest.mark.parametrize('fail', [True, False])
def test_a_thread_that_never_ends_does_not_keep_an_ended_command_alive(fail):
  """A library's non-daemon thread stuck for good (a writer on a dead disk): Python's exit
  would join it forever; the command ends EXIT_SECONDS later with its own exit status."""
  script = _STUCK.format(repo=REPO, fail=fail)
  run = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True,
                       timeout=60, check=False)
  assert run.returncode == (1 if fail else 0), run.stderr[-2000:]
  last = run.stderr.strip().splitlines()[-1]
  assert last == ('zoo: error: --workdir: it failed' if fail else 'zoo: warning: exiting without '
                  'waiting for threads that did not end within 1 s: Thread-1 (wait)'), last


_LATE = """
import atexit, sys
sys.path.insert(0, {repo!r})
from zoo import shell
from zoo.errors import ZooError
def command(argv):
  shell.start_devices('cpu')
  atexit.register(lambda: print('late: a finalizer at exit', file=sys.stderr))
  raise ZooError('--workdir: it failed')
shell.define_flags()
shell.run(command)
"""


_PEER_LOST = """
import sys
sys.path.insert(0, {repo!r})
import jax
from zoo import shell
def command(argv):  # What a step's all-reduce raised when its peer was SIGKILLed.
  raise jax.errors.JaxRuntimeError('UNKNOWN: Gloo all-reduce failed: [external/gloo/gloo/'
                                   'transport/tcp/pair.cc:538] Read error [127.0.0.1]:6063: '
                                   'Connection reset by peer')
shell.define_flags()
shell.run(command)
"""


def test_a_collective_that_lost_its_peer_is_one_line():
  """A process inside a collective when a peer dies (XLA:CPU's gloo link resets) ends as one
  line saying so, not as zoo's 'unexpected error' with a traceback (multihost_test kills a
  peer mid-run; this is the case it met in 1 of 18 runs)."""
  run = subprocess.run([sys.executable, '-c', _PEER_LOST.format(repo=REPO)], capture_output=True,
                       text=True, timeout=60, check=False)
  assert _one_line_error(run) == (
      'zoo: error: a collective with the other processes failed (UNKNOWN: Gloo all-reduce '
      'failed: [external/gloo/gloo/transport/tcp/pair.cc:538] Read error [127.0.0.1]:6063: '
      'Connection reset by peer): a peer process died or its connection broke; start every '
      'process again to resume from the newest checkpoint')


def test_a_failed_command_prints_nothing_after_its_error_line():
  """Once a command has failed, what is left of Python's exit (a dead tensorboardX writer's
  multiprocessing queue finalizer printed a traceback there) does not run: the error line
  is the last, and the exit status 1."""
  run = subprocess.run([sys.executable, '-c', _LATE.format(repo=REPO)], capture_output=True,
                       text=True, timeout=60, check=False)
  assert run.returncode == 1, run.stderr[-2000:]
  assert run.stderr.strip().splitlines()[-1] == 'zoo: error: --workdir: it failed', run.stderr
