"""Writing a dataset directory whole or not at all (zoo.prepare's output).

A prepare writes into OUTPUT.partial-<pid>, flushes it to disk and renames it to OUTPUT;
only a directory that zoo.prepare wrote is ever replaced, and an old one is put back if the
move fails. Leftovers of killed prepares are removed by the next prepare of that output.
"""
import glob
import json
import os
import shutil
from typing import Optional

from absl import logging

from zoo.errors import ConfigError
from zoo.store import storage


def is_dataset(path: str) -> bool:
  """Whether `path` (local or gs://) is a directory that zoo.prepare wrote (its metadata
  names a zoo format)."""
  try:
    meta = json.loads(storage.read_text(storage.join(path, 'metadata.json')))
    return str(meta.get('format', '')).startswith('zoo.')
  except (OSError, ValueError, AttributeError):
    return False


def check_output(output: str, overwrite: bool) -> str:
  """The absolute output path; ConfigError unless it can be written, or (with --overwrite)
  it is a dataset that zoo.prepare wrote. Removes what killed prepares of it left."""
  path = os.path.abspath(output)
  if os.path.exists(path) and not overwrite:
    raise ConfigError(f'--output: {output} exists; give --overwrite to replace it, or another '
                      '--output')
  replaceable = os.path.isdir(path) and (is_dataset(path) or not os.listdir(path))
  if os.path.exists(path) and not replaceable:
    raise ConfigError(f'--output: {output} is not a dataset that zoo.prepare wrote (no zoo '
                      'metadata.json), so --overwrite will not replace it; pick another --output')
  existing = os.path.dirname(path)
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
    raise ConfigError(f'--output: {output} cannot be written ({existing} is not a writable '
                      'directory); pick another --output')
  for leftover in glob.glob(glob.escape(path) + '.partial-*') + glob.glob(glob.escape(path) +
                                                                         '.replaced-*'):
    pid = leftover.rsplit('-', 1)[-1]
    if not (pid.isdigit() and os.path.exists(f'/proc/{pid}')):  # Its prepare is not running.
      logging.warning('removing %s, left by an interrupted prepare', leftover)
      shutil.rmtree(leftover, ignore_errors=True)
  return path


def sync(directory: str) -> None:
  """Flushes every file of `directory`, and the directory, to the disk before it is published."""
  for name in os.listdir(directory):
    fd = os.open(os.path.join(directory, name), os.O_RDONLY)
    try:
      os.fsync(fd)
    finally:
      os.close(fd)
  fd = os.open(directory, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def publish(partial: str, path: str) -> Optional[str]:
  """Moves the complete dataset into place. An old one at `path` is first renamed aside and
  put back if the move fails; returns its new name, for the caller to delete."""
  sync(partial)
  old = None
  if os.path.exists(path):
    old = f'{path}.replaced-{os.getpid()}'
    os.rename(path, old)
  try:
    os.rename(partial, path)
  except BaseException:
    if old and not os.path.exists(path):
      os.rename(old, path)
    raise
  return old


def ancestors(path: str) -> list[str]:
  """path's ancestors from the root down, and path itself."""
  parts = []
  while path not in parts and path != os.path.dirname(path):
    parts.append(path)
    path = os.path.dirname(path)
  return parts[::-1]
