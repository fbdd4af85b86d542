"""Errors that reach the user as one line, `zoo: error: ...`, and a non-zero exit."""
import logging
import os
import sys
from typing import NoReturn


class ZooError(Exception):
  """Base: the message names what is wrong and how to fix it, on one line."""


class ConfigError(ZooError, ValueError):
  """Bad input, found before anything is written."""


class CheckpointError(ZooError, ValueError):
  """A checkpoint cannot be used: mismatched, damaged or missing."""


class NonFiniteError(ZooError, FloatingPointError):
  """The training loss or parameters became NaN or infinite."""


def first_line(error: BaseException, default: str = '') -> str:
  """The first line of `error`'s message (libraries' messages run to many lines), or
  `default` if it has none."""
  return (str(error).strip().splitlines() or [default])[0]


def fail(field: str, message: str) -> NoReturn:
  """Raises the ConfigError `config.<field>: <message>`: what is wrong and how to fix it."""
  raise ConfigError(f'config.{field}: {message}')


def abort(line: str) -> NoReturn:
  """Ends the process now, from any thread, with `line` as the last line and exit 1: for a
  process whose peers must not wait for it at shutdown, or whose main thread may be stuck
  in a call that never returns (a storage that stopped answering). Nothing else runs: no
  cleanup, no exit hooks."""
  for handler in logging.getLogger().handlers:  # absl's: lines already logged come first.
    try:
      handler.flush()
    except Exception:  # pylint: disable=broad-except  # Ending anyway.
      pass
  for stream in (sys.stdout, sys.stderr):  # What the command printed, then the line.
    try:
      stream.flush()
    except Exception:  # pylint: disable=broad-except
      pass
  sys.stderr.write(line + '\n')
  sys.stderr.flush()
  os._exit(1)  # pylint: disable=protected-access
