"""One owner per workdir: a lease that the running job renews and a restart takes over once
it has expired.

`workdir/lease.json` names the owner (host, process id, start time) and when it last
renewed. Process 0 takes it before the run writes anything and renews it from a thread
every `ttl / 4` seconds; a clean exit deletes it. A second job finds a live lease and
stops with one line naming the owner. An owner that died leaves its lease behind, which
blocks nobody for long: it expires `ttl` seconds after the last renewal, and at once
when the owner was a process on this host that no longer exists (a SIGKILL, a crash).

A run that cannot renew its lease for `ttl` seconds (a storage that refuses writes or stopped
answering) ends at once with one line: from then on another job may take the workdir, and
its main thread may be stuck in a storage call that never returns, past any cleanup. What it
leaves is what a crash leaves: the newest complete checkpoint, and a lease already expired.
Releasing the lease at the end is bounded the same way.

Every read-decide-write runs under an exclusive `flock` of `workdir/lease.lock` (held for
milliseconds, deleted with the lease), so two jobs starting together cannot both win;
flock works on local disks and on NFS (v4, or v3 with lockd). A gs:// bucket has no locks:
there every write is conditional on the generation read (BucketLease). Lease times are wall
clock: hosts sharing a workdir need clocks within a fraction of `ttl` (NTP gives ms).
"""
import contextlib
import datetime
import fcntl
import json
import os
import socket
import threading
import time
import uuid
from typing import Optional

from absl import logging
import jax
from jax.experimental import multihost_utils
import numpy as np

from zoo import errors
from zoo.errors import ConfigError
from zoo.store import storage

LEASE = 'lease.json'
LOCK = 'lease.lock'
RELEASE_SECONDS = 10.0  # The most a clean exit waits to delete the lease (it expires anyway).


class WorkdirBusyError(ConfigError):
  """Another live job owns the workdir."""


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # Exists, owned by another user.
    return True
  return True


class Lease:
  """The workdir's ownership, held by this process from `acquire()` to `release()`."""

  def __init__(self, workdir: str, ttl: float):
    self.workdir, self.ttl = workdir, ttl
    self.path = storage.join(workdir, LEASE)
    self.owner = {'host': socket.gethostname(), 'pid': os.getpid(),
                  'started': datetime.datetime.now().astimezone().isoformat(timespec='seconds'),
                  'token': uuid.uuid4().hex}
    self.lost: Optional[str] = None  # Why renewing failed, if it did.
    self._stop = threading.Event()
    self._thread: Optional[threading.Thread] = None
    self._watcher: Optional[threading.Thread] = None
    self._renewed = time.monotonic()  # When the lease was last written (or acquire began).
    self._trouble = ''  # Why the last renewal failed, if it did.
    self._created: list[str] = []  # Directories that acquire() made, deepest first.

  @contextlib.contextmanager
  def _locked(self):
    """An exclusive flock of workdir/lease.lock. `release` deletes that file, so after
    locking, check that the path still names the file locked (else lock the new one)."""
    path = os.path.join(self.workdir, LOCK)
    while True:
      fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
          current = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
          current = False
        if current:
          yield
          return
      finally:
        os.close(fd)  # Also unlocks.

  def _read(self) -> Optional[dict]:
    try:
      with open(self.path, encoding='utf-8') as f:
        return json.load(f)
    except FileNotFoundError:
      return None
    except ValueError:  # Cut short by a crash mid-write (writes are atomic renames, but be safe).
      return None

  def _write(self) -> None:
    tmp = f'{self.path}.{self.owner["token"]}.tmp'
    with open(tmp, 'w', encoding='utf-8') as f:
      json.dump({**self.owner, 'renewed': time.time(), 'ttl': self.ttl}, f)
    os.replace(tmp, self.path)

  def _expired(self, held: dict) -> str:
    """Why `held` no longer binds anyone ('' if it is live)."""
    if held.get('token') == self.owner['token']:
      return 'ours'
    if held.get('host') == self.owner['host']:
      if held.get('pid') == self.owner['pid']:
        return 'left by this process'
      if not _pid_alive(int(held.get('pid', -1))):
        return f'process {held.get("pid")} on this host is gone'
    age = time.time() - float(held.get('renewed', 0))
    if age > float(held.get('ttl', self.ttl)):
      return f'not renewed for {age:.0f} s'
    return ''

  def _prepare(self) -> None:
    missing = os.path.abspath(self.workdir)  # A relative path's dirname ends at '', not '/'.
    while not os.path.exists(missing):  # Removed again by release() if nothing else is written.
      self._created.append(missing)
      missing = os.path.dirname(missing)
    os.makedirs(self.workdir, exist_ok=True)

  def _remove(self) -> None:
    os.remove(self.path)
    os.remove(os.path.join(self.workdir, LOCK))

  def acquire(self) -> None:
    """Takes the workdir, or raises WorkdirBusyError naming its live owner."""
    self._watcher = threading.Thread(target=self._watch, name='zoo-lease-watch', daemon=True)
    self._watcher.start()  # Taking the lease is bounded too.
    try:
      self._take()
    except BaseException:
      self._stop.set()
      raise
    self._renewed = time.monotonic()
    self._thread = threading.Thread(target=self._renew_loop, name='zoo-lease', daemon=True)
    self._thread.start()

  def _take(self) -> None:
    self._prepare()
    with self._locked():
      held = self._read()
      if held is not None:
        why = self._expired(held)
        if not why:
          age = time.time() - float(held.get('renewed', 0))
          raise WorkdirBusyError(
              f'--workdir: {self.workdir} is owned by a live job (host {held.get("host")}, '
              f'process {held.get("pid")}, started {held.get("started")}, renewed {age:.0f} s '
              f'ago); stop that job, or wait until its lease expires ({held.get("ttl")} s '
              'without renewal), or use another --workdir')
        logging.warning('taking over %s from host %s process %s (%s)', self.workdir,
                        held.get('host'), held.get('pid'), why)
      try:
        self._write()
      except _Taken:
        raise WorkdirBusyError(f'--workdir: {self.workdir} was taken by another job starting at '
                               'the same moment; stop one of them, or use another --workdir'
                               ) from None

  def _renew_loop(self) -> None:
    while not self._stop.wait(self.ttl / 4):
      try:
        with self._locked():
          held = self._read()
          if held is None or held.get('token') != self.owner['token']:
            self.lost = (f'host {held.get("host")} process {held.get("pid")} took it over'
                         if held else 'its lease file was deleted')
            logging.error('lost ownership of %s: %s', self.workdir, self.lost)
            return
          self._write()
        self._renewed, self._trouble = time.monotonic(), ''
      except _Taken:
        continue  # Read again: the next round says who has it.
      except Exception as e:  # pylint: disable=broad-except  # Storage trouble: keep trying.
        self._trouble = f'{type(e).__name__}: {errors.first_line(e)}'
        logging.warning('could not renew the lease on %s: %s', self.workdir, self._trouble)

  def _watch(self) -> None:
    """Ends the process once the lease has gone `ttl` seconds without being written."""
    while not self._stop.wait(min(1.0, self.ttl / 8)):
      silent = time.monotonic() - self._renewed
      if self.lost:
        return  # Taken over: the main thread stops at its next check().
      if silent > self.ttl:
        doing = 'renew' if self._thread is not None else 'take'
        errors.abort(
            f'zoo: error: --workdir: {self.workdir}: could not {doing} the lease for {silent:.0f} s '
            f'({self._trouble or "the storage did not answer"}); stopped at once, since another '
            'job may now take the workdir. The newest complete checkpoint is kept: run the same '
            'command again once the storage answers')

  def check(self) -> None:
    """Raises WorkdirBusyError if another job has taken the workdir over."""
    if self.lost:
      raise WorkdirBusyError(f'--workdir: {self.workdir}: this run lost ownership ({self.lost}); '
                             'stopped without saving, so as not to overwrite the new owner')

  def release(self) -> None:
    """Stops renewing and deletes the lease if it is still ours; a workdir that acquire()
    created and nothing else wrote to is removed again."""
    self._stop.set()
    deadline = time.monotonic() + RELEASE_SECONDS
    for thread in (self._thread, self._watcher):
      if thread is not None:  # A renewal stuck in a storage call is left behind (a daemon).
        thread.join(max(0.0, deadline - time.monotonic()))
    remover = threading.Thread(target=self._remove_if_ours, name='zoo-lease-release', daemon=True)
    remover.start()
    remover.join(max(0.0, deadline - time.monotonic()))
    if remover.is_alive():
      logging.warning('could not delete the lease %s within %.0f s; it expires %.0f s after its '
                      'last renewal', self.path, RELEASE_SECONDS, self.ttl)
    for directory in self._created:
      with contextlib.suppress(OSError):  # Not empty: the run wrote something.
        os.rmdir(directory)


  def _remove_if_ours(self) -> None:
    with contextlib.suppress(Exception), self._locked():  # Best effort: it expires anyway.
      held = self._read()
      if held is not None and held.get('token') == self.owner['token']:
        self._remove()


class _Taken(Exception):
  """A conditional write found that someone else wrote the lease since it was read."""


class BucketLease(Lease):
  """The lease as a gs:// object: no locks in a bucket, so every write is conditional on
  the generation read before it (GCS preconditions): of two jobs racing, one write fails."""

  def __init__(self, workdir: str, ttl: float):
    super().__init__(workdir, ttl)
    from google.cloud import storage as gcs  # pylint: disable=import-outside-toplevel
    bucket, _, name = self.path.removeprefix('gs://').partition('/')
    self._blob = gcs.Client().bucket(bucket).blob(name)
    self._generation = 0  # Of the lease object last read; 0: there was none.

  def _prepare(self) -> None:
    pass

  @contextlib.contextmanager
  def _locked(self):
    yield

  def _read(self) -> Optional[dict]:
    from google.api_core import exceptions  # pylint: disable=import-outside-toplevel
    while True:
      try:
        self._blob.reload()
        data = self._blob.download_as_bytes(if_generation_match=self._blob.generation)
      except exceptions.NotFound:
        self._generation = 0
        return None
      except exceptions.PreconditionFailed:  # Rewritten between the two calls: read again.
        continue
      self._generation = self._blob.generation
      try:
        return json.loads(data)
      except ValueError:  # Not a lease zoo wrote: held by nobody (overwritten conditionally).
        return None

  def _write(self) -> None:
    from google.api_core import exceptions  # pylint: disable=import-outside-toplevel
    record = json.dumps({**self.owner, 'renewed': time.time(), 'ttl': self.ttl})
    try:
      self._blob.upload_from_string(record, content_type='application/json',
                                    if_generation_match=self._generation)
    except exceptions.PreconditionFailed:
      raise _Taken() from None
    self._generation = self._blob.generation

  def _remove(self) -> None:
    self._blob.delete(if_generation_match=self._generation)


class _NotOwner:
  """What processes other than 0 hold: nothing to renew or release."""

  def check(self) -> None:
    pass

  def release(self) -> None:
    pass


def hold(workdir: str, ttl: float) -> 'Lease | _NotOwner':
  """Process 0 takes the workdir's lease for the job; every process raises
  WorkdirBusyError if it could not, before anything else is written."""
  owner, error = _NotOwner(), ''
  if jax.process_index() == 0:
    owner = (BucketLease if storage.is_remote(workdir) else Lease)(workdir, ttl)
    try:
      owner.acquire()
    except WorkdirBusyError as e:
      error = str(e)
  if jax.process_count() > 1:
    taken = bool(multihost_utils.broadcast_one_to_all(np.array(not error)))
    if not taken and not error:
      error = (f'--workdir: {workdir} is owned by another live job (process 0 says which); '
               'stop it, or use another --workdir')
  if error:
    raise WorkdirBusyError(error)
  return owner
