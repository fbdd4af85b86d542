"""A run's workdir, a local directory or a bucket path (`gs://bucket/run`): the one type
every command reads and writes a run through (training, import and export, sampling,
evaluation), so a path is a bucket or a directory in the same way everywhere and never a
local folder named `gs:`.

What a workdir holds: config.json (the resolved config), checkpoints/ (orbax steps),
metrics.jsonl and TensorBoard events (zoo.store.metrics), the lease of the job that owns it
(zoo.store.lease), and for an imported model its tokenizer.json and imported.json.
"""
import json
import os
from typing import Any, Union

from zoo.errors import ConfigError
from zoo.store import checkpoint, lease, storage


class Workdir:
  """A run's directory, local or in a bucket; `flag` names it in errors."""
  CONFIG = 'config.json'
  TOKENIZER = 'tokenizer.json'  # An imported model's own tokenizer, beside its config.

  def __init__(self, path: Union[str, os.PathLike, 'Workdir'], flag: str = '--workdir'):
    self.path = str(path.path if isinstance(path, Workdir) else path)
    self.flag = flag

  def __str__(self) -> str:
    return self.path

  def __repr__(self) -> str:
    return f'Workdir({self.path!r})'

  @property
  def remote(self) -> bool:
    return storage.is_remote(self.path)

  def join(self, *names: str) -> str:
    """A path inside the workdir (a URL stays a URL; a local path becomes absolute)."""
    return storage.join(self.path, *names)

  def is_dir(self) -> bool:
    return storage.is_dir(self.path)

  def has(self, name: str) -> bool:
    """Whether the workdir holds the file `name`."""
    return storage.is_file(self.join(name))

  def read_text(self, name: str) -> str:
    return storage.read_text(self.join(name))

  def read_json(self, name: str) -> Any:
    """A JSON file of the workdir; ConfigError naming the flag and file if it does not parse."""
    path = self.join(name)
    try:
      return json.loads(storage.read_text(path))
    except ValueError as e:
      raise ConfigError(f'{self.flag}: {path} is not valid JSON ({e})') from None

  def write_text(self, name: str, text: str) -> None:
    """Writes a file whole (see storage.write_text): complete or absent, never half."""
    storage.write_text(self.join(name), text)

  def write_json(self, name: str, obj: Any) -> None:
    """`obj` as indented JSON, or a string already in JSON."""
    self.write_text(name, obj if isinstance(obj, str) else json.dumps(obj, indent=2))

  def make(self) -> None:
    """Creates the directory and its parents (in a bucket: nothing to create)."""
    storage.path(self.path).mkdir(parents=True, exist_ok=True)

  @property
  def checkpoints(self) -> str:
    """The checkpoint directory (orbax's steps)."""
    return checkpoint.directory_of(self.path)

  def has_checkpoints(self) -> bool:
    return storage.is_dir(self.checkpoints)

  def check_writable(self) -> None:
    """ConfigError if the workdir cannot be created or written; creates nothing."""
    if self.remote:
      storage.check_bucket(self.path, self.flag)
      return
    path = os.path.abspath(self.path)
    if os.path.exists(path) and not os.path.isdir(path):
      raise ConfigError(f'{self.flag}: {self.path} exists and is not a directory; pick another '
                        'path')
    existing = path
    while not os.path.exists(existing):
      existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
      raise ConfigError(f'{self.flag}: {self.path} cannot be written ({existing} is not a '
                        'writable directory); pick a writable path')

  def check_readable(self) -> None:
    """ConfigError unless the workdir exists (a bucket's is reached first)."""
    if self.remote:
      storage.check_bucket(self.path, self.flag)
    if not self.is_dir():
      raise ConfigError(f'{self.flag}: {self.path} is not a directory; give the workdir of a '
                        'training run')

  def hold(self, ttl: float) -> 'lease.Lease | Any':
    """The job's lease on the workdir (zoo.store.lease.hold): process 0 takes it, every
    process raises WorkdirBusyError if another live job owns it."""
    return lease.hold(self.path, ttl)

  def named(self, error: BaseException) -> BaseException:
    """`error` naming the workdir if it names no file (a failed flush or close names none)."""
    return storage.named(error, self.path)
