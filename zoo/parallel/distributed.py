"""Joining a multi-process JAX job: explicit flags, an auto-detected cluster, or one process.

Must run before any other JAX work. Every process then runs the same program on the
same global mesh; see docs/pods.md "Several processes".
"""
import math
import os
from typing import Optional

from absl import logging
import jax

from zoo.errors import ConfigError


def detected_cluster() -> Optional[str]:
  """The multi-process cluster JAX's own detection would join (SLURM, Open MPI, TPU pod...).

  None where there is none, or it has a single process (an interactive `srun`, one TPU
  host): those run alone, with no coordinator port to collide on.
  """
  try:
    from jax._src import clusters  # pylint: disable=import-outside-toplevel
    for env in clusters.ClusterEnv._cluster_types:  # pylint: disable=protected-access
      if not getattr(env, 'opt_in_only_method', False) and env.is_env_present():
        return env.__name__ if env.get_process_count() > 1 else None
  except Exception as e:  # pylint: disable=broad-except  # A private API; detection is best effort.
    logging.warning('cluster detection failed (%s); running as one process unless '
                    '--coordinator_address, --num_processes and --process_id are given', e)
  return None


def cores_as_devices() -> int:
  """The CPU devices a host without accelerators gets by default: one per core, rounded
  down to a power of two (so that the usual batch sizes divide over them)."""
  cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()
  return 2 ** int(math.log2(max(cores or 1, 1)))


MAX_CPU_DEVICES = 4096  # Emulated: each costs host memory and threads.
MAX_PROCESSES = 2**17  # A typo beyond: JAX's coordinator sets up every one it waits for.


def initialize(coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None, cpu_devices: Optional[int] = None,
               initialization_timeout: int = 300, heartbeat_timeout: int = 60,
               per_core: bool = False) -> Optional[int]:
  """Sets up devices and, if this is a multi-process job, jax.distributed.

  `cpu_devices` emulates that many CPU devices (and uses no accelerator). Else, with
  `per_core`, the CPU backend gets cores_as_devices() devices: XLA:CPU runs a train step
  faster split data-parallel over cores than as one device. This changes nothing where an
  accelerator is the default backend, nor where XLA_FLAGS already sets a device count.

  A peer that does not arrive within `initialization_timeout` seconds, or stops sending
  heartbeats for `heartbeat_timeout` seconds, makes every other process exit non-zero.
  Returns the per-core device count if it set one.
  """
  per_core_devices = None
  if cpu_devices is not None and not 1 <= cpu_devices <= MAX_CPU_DEVICES:
    raise ConfigError(f'--cpu_devices: must be in [1, {MAX_CPU_DEVICES}], got {cpu_devices}')
  for flag, seconds in (('initialization_timeout', initialization_timeout),
                        ('heartbeat_timeout', heartbeat_timeout)):
    if seconds < 1:
      raise ConfigError(f'--{flag}: must be at least 1 second, got {seconds}')
  if cpu_devices:
    jax.config.update('jax_platforms', 'cpu')
    jax.config.update('jax_num_cpu_devices', cpu_devices)
  elif per_core and 'xla_force_host_platform_device_count' not in os.environ.get('XLA_FLAGS', ''):
    per_core_devices = cores_as_devices()
    jax.config.update('jax_num_cpu_devices', per_core_devices)
  explicit = (coordinator_address, num_processes, process_id)
  timeouts = {'initialization_timeout': initialization_timeout,
              'heartbeat_timeout_seconds': heartbeat_timeout}
  if any(v is not None for v in explicit):
    if any(v is None for v in explicit):
      raise ConfigError('--coordinator_address, --num_processes and --process_id go together; '
                        'give all three (or none, to auto-detect a cluster)')
    host, _, port = coordinator_address.rpartition(':')
    if not host or not port.isdigit():
      raise ConfigError(f'--coordinator_address: {coordinator_address!r} is not host:port; give '
                        "process 0's address and a free port, e.g. 10.0.0.2:1234")
    if not 1 <= num_processes <= MAX_PROCESSES:
      raise ConfigError(f'--num_processes: must be in [1, {MAX_PROCESSES}], got {num_processes}')
    if not 0 <= process_id < num_processes:
      raise ConfigError(f'--process_id: {process_id} is not in '
                        f'[0, --num_processes={num_processes})')
    jax.distributed.initialize(coordinator_address, num_processes, process_id, **timeouts)
  elif not cpu_devices and (cluster := detected_cluster()):  # Emulated devices: always local.
    logging.info('detected a %s: joining its distributed job', cluster)
    jax.distributed.initialize(**timeouts)
  return per_core_devices
