"""Tracing chosen train steps with jax.profiler (`config.profile.steps`)."""
import os
from typing import Any

from absl import logging
import jax


class Profile:
  """Traces steps [a, b) into workdir/profile (TensorBoard's profile tab or Perfetto read
  it); with several processes each writes workdir/profile/process_<i> (trace files are
  named by host, which processes on one host share). () traces nothing."""

  def __init__(self, steps: tuple, workdir: str):
    self.steps, self.active = tuple(steps), False
    self.directory = os.path.join(workdir, 'profile')
    if jax.process_count() > 1:
      self.directory = os.path.join(self.directory, f'process_{jax.process_index()}')

  def before(self, step: int) -> None:
    if self.steps and step == self.steps[0]:
      jax.profiler.start_trace(self.directory)
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
