"""Tracing chosen train steps with jax.profiler (`config.profile.steps`)."""
import os
import shutil
import tempfile
from typing import Any

from absl import logging
import jax

from zoo.store import storage


class Profile:
  """Traces steps [a, b) into workdir/profile (TensorBoard's profile tab or Perfetto read
  it); with several processes each writes workdir/profile/process_<i> (trace files are
  named by host, which processes on one host share). () traces nothing."""

  def __init__(self, steps: tuple, workdir: str):
    self.steps, self.active = tuple(steps), False
    self.directory = storage.join(workdir, 'profile')
    if jax.process_count() > 1:
      self.directory = storage.join(self.directory, f'process_{jax.process_index()}')
    # The profiler writes local files; for a bucket, trace here and copy over at the end.
    self.local = tempfile.mkdtemp(prefix='zoo-profile-') if storage.is_remote(workdir) else ''

  def before(self, step: int) -> None:
    if self.steps and step == self.steps[0]:
      jax.profiler.start_trace(self.local or self.directory)
      self.active = True

  def after(self, done: int, state: Any) -> None:
    if self.active and done == self.steps[1]:
      jax.block_until_ready(state)  # The trace ends after the last traced step ran.
      self.close()
      logging.info('profile of steps [%d, %d) written to %s', *self.steps, self.directory)

  def close(self) -> None:
    if self.active:
      jax.profiler.stop_trace()
      self.active = False
      if self.local:
        for root, _, files in os.walk(self.local):
          for name in files:
            source = os.path.join(root, name)
            target = storage.path(self.directory) / os.path.relpath(source, self.local)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(storage.path(source).read_bytes())
        shutil.rmtree(self.local, ignore_errors=True)
