"""Device memory: what a device lets a run use, a compiled step's memory, what to change when
a step does not fit, and a run's out-of-memory error as that one line (the plan,
zoo.run.plan, gives the same advice before anything runs).

JAX's allocator on a GPU raises `RESOURCE_EXHAUSTED: Out of memory while trying to allocate
54.12GiB with allocator GPU_0_bfc` as a JaxRuntimeError when a step first runs; a TPU's
compiler refuses a program with `RESOURCE_EXHAUSTED: ... Ran out of memory in memory space
hbm ...`. Both become a DeviceMemoryError naming what was asked and what the device has.
"""
import dataclasses
import re
import time
from typing import Any, Optional

import jax

from zoo.errors import ZooError
from zoo.parallel import topology


class DeviceMemoryError(ZooError, MemoryError):
  """A step needs more device memory than the devices have."""


def host_bytes_available() -> Optional[int]:
  """The host memory a process can still take (Linux's MemAvailable), if known."""
  try:
    with open('/proc/meminfo', encoding='ascii') as f:
      info = dict(line.split(':', 1) for line in f)
    return int(info['MemAvailable'].split()[0]) * 1024
  except (OSError, KeyError, ValueError):
    return None


def limit_per_device() -> tuple[Optional[int], str]:
  """(bytes each of this process's devices may use, where that figure comes from): what an
  accelerator's runtime lets JAX use, or on CPU the host's free memory shared by its
  devices; (None, '') where neither is known."""
  local = jax.local_devices()
  usable = topology.local_memory(local[0])
  if usable:
    return usable[0], f'a {local[0].device_kind} device has'
  host = host_bytes_available()
  if host is None:
    return None, ''
  return host // len(local), (f'this host has free for each of its {len(local)} devices'
                              if len(local) > 1 else 'this host has free')


@dataclasses.dataclass
class Compiled:
  """One step compiled for the plan's devices, or the compiler's refusal."""
  program: Any = None            # The compiled program, if it compiled.
  memory: Optional[dict] = None  # Per device: arguments, outputs, aliased, ..., peak.
  seconds: float = 0.0
  refusal: str = ''              # The compiler's first line, if it refused.
  needed: Optional[int] = None   # An HBM refusal's figures (bytes per device).

  @property
  def peak(self) -> Optional[int]:
    """Its peak per device, or what a refusal said it needs; None where neither is known."""
    return self.memory['peak'] if self.memory else self.needed


def size_text(n: float) -> str:
  """Bytes as MiB, or GiB from 1 GiB on."""
  return f'{n / 2**30:,.2f} GiB' if n >= 2**30 else f'{n / 2**20:,.2f} MiB'


def compiled_memory(program, platform: str) -> Optional[dict]:
  """Per device: the analysis's sizes, and the peak: on TPU the compiler's own (its
  temporaries are not all live at once, and a sum refuses batches it accepts), elsewhere
  the sum of what is live at once at worst."""
  m = program.memory_analysis()
  if m is None:
    return None
  memory = {'arguments': m.argument_size_in_bytes, 'outputs': m.output_size_in_bytes,
            'aliased': m.alias_size_in_bytes, 'temporaries': m.temp_size_in_bytes,
            'code': m.generated_code_size_in_bytes}
  if platform == 'tpu':
    memory['peak'] = m.peak_memory_in_bytes
  else:  # Donated state: outputs that alias arguments take no extra memory.
    memory['peak'] = (memory['arguments'] + memory['outputs'] - memory['aliased']
                      + memory['temporaries'] + memory['code'])
  return memory


def compile_step(platform: str, jitted, *args) -> Compiled:
  """Lowers and compiles for `platform`'s devices; a RESOURCE_EXHAUSTED refusal is
  returned, not raised."""
  t0 = time.perf_counter()
  lowered = jitted.lower(*args)
  try:
    program = lowered.compile()
  except Exception as e:  # pylint: disable=broad-except  # XlaRuntimeError and kin.
    if 'RESOURCE_EXHAUSTED' not in str(e):
      raise
    return Compiled(seconds=time.perf_counter() - t0, refusal=str(e).strip().splitlines()[0],
                    needed=_needed(str(e)))
  return Compiled(program, compiled_memory(program, platform), time.perf_counter() - t0)


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
