"""Device memory: what to change when a step does not fit, and a run's out-of-memory error as
that one line (the plan, zoo.run.plan, gives the same advice before anything runs).

JAX's allocator on a GPU raises `RESOURCE_EXHAUSTED: Out of memory while trying to allocate
54.12GiB with allocator GPU_0_bfc` as a JaxRuntimeError when a step first runs; a TPU's
compiler refuses a program with `RESOURCE_EXHAUSTED: ... Ran out of memory in memory space
hbm ...`. Both become a DeviceMemoryError naming what was asked and what the device has.
"""
import re
from typing import Optional

import jax

from zoo.errors import ZooError
from zoo.parallel import topology


class DeviceMemoryError(ZooError, MemoryError):
  """A step needs more device memory than the devices have."""


def advice(platform: str) -> str:
  """What to change to make a step smaller (its activations, its state's share per device)."""
  change = ('shard more (mesh, rules: fsdp_rules), or lower train.batch_size, or raise '
            'train.microbatches or model.remat')
  if platform == 'tpu':
    change += ', or set model.attention=splash (long sequences)'
  elif platform in ('gpu', 'cuda'):
    change += ", or keep model.attention='auto' with a bfloat16 model (cuDNN's kernel)"
  return change


# The runtime's and compilers' words for a device out of its main memory (a TPU kernel's
# scoped VMEM running out is another matter: no batch size or sharding advice fixes that).
_OOM = re.compile(r'Out of memory while trying to allocate|Failed to allocate request for|'
                  r'exceeds available HBM|memory space hbm')
_ASKED = re.compile(r'(?:trying to allocate|allocate request for) ([0-9.]+\s*[KMGT]?i?B)')
_HBM_USED = re.compile(r'Used ([0-9.]+)([KMGT]?) of ([0-9.]+)([KMGT]?) hbm')


def is_device_oom(error: BaseException) -> bool:
  """Whether `error` is a device (not host) out-of-memory from the runtime or a compiler."""
  text = str(error)
  return (isinstance(error, jax.errors.JaxRuntimeError) and 'RESOURCE_EXHAUSTED' in text
          and bool(_OOM.search(text)))


def _needed(text: str) -> Optional[int]:
  """The bytes a TPU compiler's refusal says the program needs."""
  refused = topology.oom_figures(text)
  if refused:
    return refused[0]
  used = _HBM_USED.search(text)
  return int(float(used.group(1)) * topology.UNITS[used.group(2)]) if used else None


def oom_line(error: BaseException, device: Optional[jax.Device] = None) -> str:
  """The run's out-of-memory as one line: what was asked, what the device lets JAX use,
  what to change."""
  text = str(error)
  device = device or jax.local_devices()[0]
  asked, needed = _ASKED.search(text), _needed(text)
  if asked:
    what = f'a step asked the allocator for {asked.group(1).replace(" ", "")} more'
  elif needed:
    what = f'the compiler found the step needs {needed / 2**30:.2f} GiB'
  else:
    what = f'"{text.strip().splitlines()[0][:200]}"'
  usable = topology.local_memory(device)
  has = (f'{device.device_kind} lets JAX use {usable[0] / 2**30:.2f} GiB ({usable[1]})'
         + (f', {usable[2] / 2**30:.2f} GiB of it in use' if usable[2] is not None else '')
         if usable else f'{device.device_kind} reports no memory figures')
  return (f'device out of memory: {what}; {has}; {advice(device.platform)}; '
          '`--dry_run` prints the step\'s peak per device before a run')
