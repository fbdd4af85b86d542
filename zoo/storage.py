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
