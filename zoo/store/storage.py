"""Workdir paths on a local disk or in a bucket (`gs://bucket/path`): one set of file
operations for both, through `etils.epath` (gcsfs for buckets), which orbax also uses.

Orbax and tensorstore write checkpoints to buckets themselves; this module is for the
rest: JSON files, metrics, listings, renames. Local paths keep plain `os` semantics.
"""
import os
from typing import Union

from etils import epath

SCHEMES = ('gs://',)


def is_remote(path: Union[str, os.PathLike]) -> bool:
  return '://' in str(path)


def _uncached_listings() -> None:
  """gcsfs caches directory listings for the life of its filesystem object, which etils
  and orbax share: a process would not see the steps another job (or a run it started)
  wrote since it first listed a directory. Listings are made fresh, before that object
  exists (fsspec applies its config when it builds one)."""
  import fsspec  # pylint: disable=import-outside-toplevel
  fsspec.config.conf.setdefault('gcs', {})['use_listings_cache'] = False


def path(p: Union[str, os.PathLike]) -> epath.Path:
  """An epath.Path: absolute for a local path, unchanged for a bucket URL."""
  if is_remote(p):
    _uncached_listings()
    return epath.Path(str(p))
  return epath.Path(os.path.abspath(p))


def join(base: str, *names: str) -> str:
  """`base/names...` as a string: a URL stays a URL, a local path becomes absolute."""
  return str(path(base).joinpath(*names))


def read_text(p: Union[str, os.PathLike]) -> str:
  return path(p).read_text(encoding='utf-8')


def write_text(p: Union[str, os.PathLike], text: str) -> None:
  """Writes a file whole. In a bucket an object appears complete or not at all; locally
  the file is written aside and renamed over the old one."""
  target = path(p)
  if is_remote(p):
    target.write_text(text, encoding='utf-8')
    return
  tmp = target.with_name(f'.{target.name}.tmp-{os.getpid()}')
  tmp.write_text(text, encoding='utf-8')
  os.replace(tmp, target)


def read_bytes(p: Union[str, os.PathLike]) -> bytes:
  return path(p).read_bytes()


def is_file(p: Union[str, os.PathLike]) -> bool:
  return path(p).is_file()


def is_dir(p: Union[str, os.PathLike]) -> bool:
  """A directory; in a bucket, a prefix that holds objects."""
  return path(p).is_dir()


def _gcs():
  """fsspec's gcsfs filesystem (shared with etils and orbax), listings uncached."""
  import fsspec  # pylint: disable=import-outside-toplevel
  _uncached_listings()
  return fsspec.filesystem('gcs')


def size(p: Union[str, os.PathLike]) -> int:
  return _gcs().size(str(p)) if is_remote(p) else os.path.getsize(p)


class RangeReader:
  """Byte ranges of one file, read on demand: pread on a local file, one ranged GET per
  read in a bucket (never the whole object: a process reads only its rows' windows)."""

  def __init__(self, p: str):
    self.path = p
    if is_remote(p):
      self._fs, self._fd = _gcs(), None
    else:
      self._fs, self._fd = None, os.open(p, os.O_RDONLY)
    self.bytes_read = 0

  def read(self, offset: int, count: int) -> bytes:
    """`count` bytes from `offset`; bytes_read counts what was fetched."""
    if self._fd is not None:
      fetched = os.pread(self._fd, count, offset)
    else:
      fetched = self._fs.cat_file(self.path, start=offset, end=offset + count)
    self.bytes_read += len(fetched)
    return fetched

  def close(self) -> None:
    if self._fd is not None:
      os.close(self._fd)
      self._fd = None


def upload_tree(local: str, url: str, last: str) -> None:
  """Copies the local directory `local` to the bucket path `url`, the file named `last`
  after all others: readers that check for it never see a partial copy as complete."""
  files = sorted(os.path.relpath(os.path.join(d, f), local)
                 for d, _, names in os.walk(local) for f in names)
  for name in sorted(files, key=lambda n: n == last):
    target = path(url).joinpath(name)
    with open(os.path.join(local, name), 'rb') as src, target.open('wb') as dst:
      while chunk := src.read(16 * 2**20):
        dst.write(chunk)


def remove_tree(url: str) -> None:
  """Removes a directory (a bucket prefix) and everything under it, if it exists."""
  p = path(url)
  if p.exists():
    p.rmtree()


def listdir(p: Union[str, os.PathLike]) -> list[str]:
  """Names in a directory; [] if it does not exist."""
  directory = path(p)
  try:
    return [child.name for child in directory.iterdir()]
  except (FileNotFoundError, NotADirectoryError):
    return []


def check_bucket(url: str, flag: str) -> None:
  """ConfigError unless `url` is in a supported scheme and its bucket can be listed."""
  from zoo.errors import ConfigError  # pylint: disable=import-outside-toplevel
  if not url.startswith(SCHEMES):
    raise ConfigError(f'{flag}: {url}: only {", ".join(SCHEMES)} buckets and local paths are '
                      'supported; use a gs:// bucket or a directory that every host mounts')
  import importlib.util  # pylint: disable=import-outside-toplevel
  if importlib.util.find_spec('gcsfs') is None:
    raise ConfigError(f"{flag}: {url}: gs:// paths need gcsfs: pip install -e '.[gcs]'")
  bucket = '/'.join(url.split('/')[:3])
  try:
    reachable = path(bucket).exists()
  except Exception as e:  # pylint: disable=broad-except  # gcsfs raises many types.
    raise ConfigError(f'{flag}: cannot reach bucket {bucket} ({type(e).__name__}: '
                      f'{str(e).splitlines()[0] if str(e) else ""}); check the credentials '
                      '(gcloud auth application-default login) and the network') from None
  if not reachable:
    raise ConfigError(f'{flag}: bucket {bucket} does not exist; create it (gcloud storage '
                      'buckets create) or fix the name')


def named(error: BaseException, p: Union[str, os.PathLike]) -> BaseException:
  """`error` with the path it concerns, if it names none (a failed flush or close names
  none), so that its one line says where."""
  if isinstance(error, OSError) and not error.filename:
    error.filename = str(p)
  return error
