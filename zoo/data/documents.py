"""Documents for `python -m zoo.prepare text`: UTF-8 files, JSON Lines or Parquet, by glob.

A `.jsonl` (or `.json`, one object per line) file holds one document per line, in a named
field; a `.parquet` file one per row, in a named column (read in batches with pyarrow); any
other file is one UTF-8 document.
"""
import fnmatch
import glob
import json
import os
from typing import Iterator, Sequence

from zoo.errors import ConfigError

JSON_LINES = ('.jsonl', '.json')
PARQUET = ('.parquet',)


def expand(patterns: list[str], exclude: Sequence[str] = ()) -> list[str]:
  """The files the patterns name (globs, `**` recursive), less those matching an `exclude`
  glob, sorted; ConfigError if a pattern names none."""
  if not patterns:
    raise ConfigError('--input: missing; give files or globs, e.g. --input="corpus/*.txt"')
  files = set()
  for pattern in patterns:
    matched = [p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)
               and not any(fnmatch.fnmatch(p, x) for x in exclude)]
    if not matched:
      raise ConfigError(f'--input: {pattern} matches no file; check the path (quote globs so '
                        'that the shell does not expand them)')
    files.update(matched)
  return sorted(files)


def undecodable(files: list[str]) -> list[str]:
  """The plain-text files among `files` that are not UTF-8."""
  bad = []
  for path in files:
    if not path.endswith(JSON_LINES + PARQUET):
      try:
        with open(path, encoding='utf-8') as f:
          while f.read(2**24):
            pass
      except UnicodeDecodeError:
        bad.append(path)
  return bad


def read(path: str, field: str = 'text', column: str = 'text') -> Iterator[str]:
  """The documents of one file; ConfigError naming the file (and line) if one is unreadable."""
  if path.endswith(JSON_LINES):
    yield from _json_lines(path, field)
  elif path.endswith(PARQUET):
    yield from _parquet(path, column)
  else:
    try:
      with open(path, encoding='utf-8') as f:
        yield f.read()
    except UnicodeDecodeError as e:
      raise ConfigError(f'--input: {path} is not UTF-8 text ({e.reason} at byte {e.start}); '
                        'convert it, leave it out (--exclude) or give --skip_undecodable') from None


def json_records(path: str, flag: str = '--input') -> Iterator[tuple[int, object]]:
  """(line number, record) for each non-blank line of a JSON Lines file; ConfigError naming
  `flag`, the file and the line if a line is not JSON or the file not UTF-8."""
  with open(path, encoding='utf-8') as f:
    for number, line in _numbered_lines(f, path, flag):
      if not line.strip():
        continue
      try:
        yield number, json.loads(line)
      except ValueError as e:
        raise ConfigError(f'{flag}: {path} line {number} is not JSON ({e}); give JSON Lines, '
                          'one object per line') from None


def _json_lines(path, field):
  for number, record in json_records(path):
    text = record.get(field) if isinstance(record, dict) else None
    if not isinstance(text, str):
      raise ConfigError(f'--field: {path} line {number} has no string field {field!r} (keys: '
                        f'{", ".join(record) if isinstance(record, dict) else "none"}); '
                        'name the field that holds the text')
    yield text


def _numbered_lines(f, path, flag='--input'):
  number = 0
  while True:
    try:
      line = f.readline()
    except UnicodeDecodeError as e:
      raise ConfigError(f'{flag}: {path} line {number + 1} is not UTF-8 ({e.reason}); convert '
                        'the file or leave it out (--exclude)') from None
    if not line:
      return
    number += 1
    yield number, line


def _parquet(path, column):
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
  try:
    table = pq.ParquetFile(path)
  except Exception as e:  # pylint: disable=broad-except  # pyarrow raises its own types.
    raise ConfigError(f'--input: {path} is not a readable Parquet file ({e})') from None
  names = table.schema_arrow.names
  if column not in names:
    raise ConfigError(f'--column: {path} has no column {column!r} (columns: {", ".join(names)}); '
                      'name the column that holds the text')
  try:
    for batch in table.iter_batches(columns=[column], batch_size=4096):
      for text in batch.column(0).to_pylist():
        if isinstance(text, str):
          yield text
        elif text is not None:
          raise ConfigError(f'--column: {path} column {column!r} holds {type(text).__name__} '
                            'values, not text; name a string column')
  except ConfigError:
    raise
  except Exception as e:  # pylint: disable=broad-except  # pyarrow raises its own types.
    raise ConfigError(f'--input: {path} cannot be read past its header ({type(e).__name__}: '
                      f'{str(e)[:120]}); check or replace the file') from None
