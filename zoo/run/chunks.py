"""The language-model loss's chunks of the sequence, chosen for the machine
(model.loss_chunks=0, auto).

zoo.models.layers.token_losses computes the vocabulary logits a chunk of the sequence at a
time, so that a large vocabulary never holds [batch, length, vocabulary] of them at once.
Chunking costs time: each chunk's logits are computed again in the backward pass, under a
loop (at 32 chunks, a third of a Llama-3.2-1B step on an H200). So auto takes the fewest
chunks whose train step fits the device's memory beside the step's other temporaries, as
the compiler counts them: whole logits wherever they fit.

The search compiles the train step (a compiled step is cached in memory, so the loop's own
compile of the chosen one costs nothing more): first at the fewest chunks that are not
hopeless (the state and one chunk's logits alone fit), then, while the compiler's peak
passes FILL of the limit, at the fewest chunks that its measured other memory and the
logits' estimated bytes (BYTES_PER_LOGIT) say fit; at most as many as the memory-lean
rule (layers.loss_chunks), which is also what a step gets where no memory figure is known. Where the whole logits are
small (at most layers.LOSS_CHUNK_ELEMENTS per sequence) nothing is compiled: one chunk.
"""
import dataclasses
import math
from typing import Optional

import jax
import numpy as np

from zoo.models import layers
from zoo.parallel import sharding
from zoo.run import memory, rollouts
from zoo.run import setup as setup_lib

# The share of a device's limit the chosen step may fill: the rest is the runtime's
# (prefetched batches, the allocator's fragmentation, kernels' workspaces).
FILL = 0.9
# Bytes a train step holds per logit of a chunk at its peak (float32 logits, their gradient
# and the compilers' copies), measured at whole logits (d 256, 8 x 512 tokens, vocabulary
# 32,768; JAX 0.10.2): 12.3 on CPU, 8.0 on an H100 target, 4.0 on v5p. An estimate for
# choosing what to compile next: the compiled step's own peak is what is judged.
BYTES_PER_LOGIT = {'cpu': 12, 'gpu': 8, 'cuda': 8, 'tpu': 4}

@dataclasses.dataclass(frozen=True)
class Choice:
  """The loss's chunks of a run, and why."""
  chunks: int
  tokens: int           # Positions of a sequence in a chunk.
  logit_bytes: int      # One chunk's float32 logits per device.
  reason: str
  peaks: dict = dataclasses.field(default_factory=dict)  # Chunks tried -> the step's peak.
  # The train step compiled at `chunks` while choosing (None: nothing was compiled).
  compiled: Optional[memory.Compiled] = dataclasses.field(default=None, repr=False)

  def line(self) -> str:
    return (f'loss: logits of {self.chunks} chunk(s) of {self.tokens:,} tokens in turn, one '
            f'live at a time: {_size(self.logit_bytes)} per device (float32); {self.reason}')


def logit_bytes(setup: setup_lib.Setup, chunks: int, rows: Optional[int] = None) -> int:
  """One chunk's float32 logits per device: its rows (a microbatch's; `rows` of a global
  batch if given; a preference pair's two sequences count as two), its positions (split
  over the sequence's shards) and the vocabulary's shard."""
  shape = setup.batch['inputs'].shape  # [batch, (2 for DPO's pairs,) length]
  rows = rows or shape[0] // setup.config.train.microbatches
  per_device = setup.batch_sharding.shard_shape((rows,))[0] * math.prod(shape[1:-1])
  length = shape[-1]
  vocab = layers.padded_vocab_size(setup.model.vocab_size)
  vocab_axes = next((axes for name, axes in setup.rules if name == 'act_vocab'), None)
  vocab_shards = math.prod(setup.mesh.shape[a] for a in sharding.mesh_axes_of(vocab_axes))
  tokens = length // chunks // sharding.sequence_shards(setup.mesh, setup.rules)
  return 4 * per_device * max(tokens, 1) * (vocab // vocab_shards)


def fitted(setup: setup_lib.Setup, limit: Optional[int] = None, source: str = ''
           ) -> tuple[setup_lib.Setup, Optional[Choice]]:
  """`setup` with its language model's loss chunks chosen (a Setup whose config says them),
  and the Choice; `setup` and None for models without the chunked loss. `limit`: bytes a
  device may use (default: what this machine's devices let JAX use, the least over the
  processes), `source` where that figure comes from."""
  if not hasattr(setup.model, 'loss_chunks'):
    return setup, None
  length = setup.batch['inputs'].shape[-1]
  vocab = layers.padded_vocab_size(setup.model.vocab_size)
  most = layers.loss_chunks(0, length, vocab)  # The memory-lean rule: the most auto takes.
  if setup.model.loss_chunks:
    return setup, _choice(setup, setup.model.loss_chunks, 'set by model.loss_chunks')
  # Below, `setup` itself where auto's own rule (layers.loss_chunks) gives the chunks chosen.
  if most == 1:
    return setup, _choice(setup, 1, f'whole logits: a sequence has {length:,} x '
                                  f'{vocab:,}, at most {layers.LOSS_CHUNK_ELEMENTS:,}')
  if limit is None:
    limit, source = memory.limit_per_device()
    limit = _least_over_processes(limit)
  if not limit:
    return setup, _choice(setup, most, f'no memory figure for {_platform(setup)}: '
                                     'the memory-lean rule, at most '
                                     f'{layers.LOSS_CHUNK_ELEMENTS:,} logits of a sequence a chunk')
  return _search(setup, most, int(FILL * limit), f'{FILL:.0%} of {_size(limit)} per device'
                 + (f' ({source})' if source else ''))


def _search(setup: setup_lib.Setup, most: int, budget: int, where: str
            ) -> tuple[setup_lib.Setup, Choice]:
  """The fewest chunks, at most `most`, whose train step's peak (with GRPO's reference
  parameters beside it) is within `budget` bytes per device, and whose eval step's logits
  fit beside the state."""
  length = setup.batch['inputs'].shape[-1]
  shards = sharding.sequence_shards(setup.mesh, setup.rules)
  candidates = [n for n in range(1, most) if length % n == 0 and length // n % shards == 0]
  candidates.append(most)
  beside = rollouts.reference_bytes(setup)
  held = (sharding.per_device_bytes(setup.abstract_state())
          + sharding.per_device_bytes(setup.batch) + beside)
  per_logit = BYTES_PER_LOGIT.get(_platform(setup), max(BYTES_PER_LOGIT.values())) / 4
  eval_rows = setup.config.eval.batch_size

  def evaluates(n: int) -> bool:  # The eval step: the state and its float32 logits, twice.
    return held + 2 * logit_bytes(setup, n, eval_rows) <= budget

  # Hopeless: the state, the batch and one chunk's float32 logits alone pass the budget.
  n = next((c for c in candidates if held + logit_bytes(setup, c) <= budget and evaluates(c)),
           most)
  peaks = {}
  while True:
    chosen = _at(setup, n)
    compiled = _compile(chosen)
    if compiled.refusal and compiled.needed is None:  # Not memory: the caller's to report.
      return chosen, _choice(setup, n, f'the compiler refused {n} chunk(s) for another reason '
                             f'than memory: {compiled.refusal}', peaks, compiled)
    if compiled.peak is None:
      return setup, _choice(setup, most, 'no memory analysis of the compiled step '
                                       f'on {_platform(setup)}: the memory-lean rule', peaks)
    peaks[n] = compiled.peak + beside
    tried = f'; {_tried(peaks, n)} did not' if len(peaks) > 1 else ''
    if peaks[n] <= budget:
      return chosen, _choice(setup, n, f"{'whole logits' if n == 1 else 'the fewest that fit'}"
                             f": the train step's peak {_size(peaks[n])} fits in {where}{tried}",
                             peaks, compiled)
    if n == most:
      return chosen, _choice(setup, n, f"the most auto takes: the train step's peak "
                             f'{_size(peaks[n])} passes {where}{tried}', peaks, compiled)
    other = peaks[n] - per_logit * logit_bytes(setup, n)  # The step's other memory, measured.
    n = next((c for c in candidates if c > n and evaluates(c)
              and other + per_logit * logit_bytes(setup, c) <= budget), most)


def _tried(peaks: dict, chosen: int) -> str:
  return ', '.join(f'{n} chunk(s) ({_size(p)})' if p is not None else f'{n} chunk(s) (refused)'
                   for n, p in sorted(peaks.items()) if n != chosen)


def _compile(setup: setup_lib.Setup) -> memory.Compiled:
  with setup.scope():
    return memory.compile_step(_platform(setup), setup.jit_train_step(), setup.abstract_state(),
                               setup.batch)


def _at(setup: setup_lib.Setup, chunks: int) -> setup_lib.Setup:
  """`setup` with model.loss_chunks=`chunks` (its model, programs and config)."""
  if setup.model.loss_chunks == chunks:
    return setup
  config = setup.config.copy_and_resolve_references()
  config.model.loss_chunks = chunks
  built = setup_lib.build(config, setup.dataset, mesh=setup.mesh, rules=setup.rules)
  return dataclasses.replace(built, choice_tasks=setup.choice_tasks)


def _choice(setup: setup_lib.Setup, chunks: int, reason: str, peaks: Optional[dict] = None,
            compiled: Optional[memory.Compiled] = None) -> Choice:
  length = setup.batch['inputs'].shape[-1]
  return Choice(chunks, length // chunks, logit_bytes(setup, chunks), reason, peaks or {},
                compiled)


def _platform(setup: setup_lib.Setup) -> str:
  return setup.mesh.devices.flat[0].platform


def _least_over_processes(limit: Optional[int]) -> Optional[int]:
  """The smallest of every process's `limit` (they must choose the same program)."""
  if jax.process_count() == 1 or limit is None:
    return limit
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  return int(np.min(multihost_utils.process_allgather(np.int64(limit))))


def _size(n: float) -> str:
  return f'{n / 2**30:,.2f} GiB' if n >= 2**30 else f'{n / 2**20:,.2f} MiB'
