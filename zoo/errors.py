"""Errors that reach the user as one line, `zoo: error: ...`, and a non-zero exit."""
from typing import NoReturn


class ZooError(Exception):
  """Base: the message names what is wrong and how to fix it, on one line."""


class ConfigError(ZooError, ValueError):
  """Bad input, found before anything is written."""


class CheckpointError(ZooError, ValueError):
  """A checkpoint cannot be used: mismatched, damaged or missing."""


class NonFiniteError(ZooError, FloatingPointError):
  """The training loss or parameters became NaN or infinite."""


def fail(field: str, message: str) -> NoReturn:
  """Raises the ConfigError `config.<field>: <message>`: what is wrong and how to fix it."""
  raise ConfigError(f'config.{field}: {message}')
