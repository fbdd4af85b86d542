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
hopeless (the state, the batch and one chunk's float32 logits alone fit), then, while the
compiler's peak passes FILL of the limit, at the fewest chunks that the step's measured
other memory and the logits' estimated bytes (BYTES_PER_LOGIT) say fit; a count the
compiler refuses for another reason than memory is stepped over. The eval step, compiled
at a count whose train step fits, must fit too. At most as many chunks as the memory-lean
rule (layers.loss_chunks) takes, which is also what a step gets where no memory figure is
known; where whole logits are small (at most layers.LOSS_CHUNK_ELEMENTS of a sequence)
nothing is compiled: one chunk. Every process of a run compiles the same program: they
take the least limit of any and, after choosing, the most chunks any chose.
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
  # The steps compiled at `chunks` while choosing: {'train': Compiled, 'eval': Compiled}.
  compiled: dict = dataclasses.field(default_factory=dict, repr=False)

  def line(self) -> str:
    return (f'loss: logits of {self.chunks} chunk(s) of {self.tokens:,} tokens in turn, one '
            f'live at a time: {memory.size_text(self.logit_bytes)} per device (float32); '
            f'{self.reason}')


def logit_bytes(setup: setup_lib.Setup, chunks: int, rows: Optional[int] = None) -> int:
  """One chunk's float32 logits per device: its rows (a microbatch's; `rows` of a global
  batch if given; a preference pair's two sequences count as two), its positions (split
  over the sequence's shards) and the vocabulary's shard."""
  shape = setup.batch['inputs'].shape  # [batch, (2 for DPO's pairs,) length]
  rows = rows or shape[0] // setup.config.train.microbatches
  per_device = setup.batch_sharding.shard_shape((rows,))[0] * math.prod(shape[1:-1])
  length = shape[-1]
  vocab = layers.padded_vocab_size(setup.model.vocab_size)
  vocab_shards = sharding.shards(setup.mesh, setup.rules, 'act_vocab')
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
    return setup, _choice(setup, 1, f'whole logits: a sequence has {length:,} x {vocab:,}, '
                          f'at most {layers.LOSS_CHUNK_ELEMENTS:,}')
  if limit is None:
    limit, source = memory.limit_per_device()
    limit = _agreed(limit, min)
  if not limit:
    return setup, _choice(setup, most, f'no memory figure for {_platform(setup)}: the '
                          f'memory-lean rule, at most {layers.LOSS_CHUNK_ELEMENTS:,} logits of a '
                          'sequence a chunk')
  chosen, choice = _search(setup, most, int(FILL * limit), f'{FILL:.0%} of '
                           f'{memory.size_text(limit)} per device'
                           + (f' ({source})' if source else ''))
  agreed = _agreed(choice.chunks, max)
  if agreed != choice.chunks:  # Another process's devices needed more.
    chosen = _at(setup, agreed)
    choice = _choice(setup, agreed, f'{choice.reason}; {agreed} as another process chose',
                     choice.peaks)
  return chosen, choice


def _search(setup: setup_lib.Setup, most: int, budget: int, where: str
            ) -> tuple[setup_lib.Setup, Choice]:
  """The fewest chunks, at most `most`, whose train step's peak (with GRPO's reference
  parameters beside it) and eval step's peak are within `budget` bytes per device."""
  length = setup.batch['inputs'].shape[-1]
  shards = sharding.sequence_shards(setup.mesh, setup.rules)
  candidates = [n for n in range(1, most) if length % n == 0 and length // n % shards == 0]
  candidates.append(most)
  state = setup.abstract_state()
  beside = rollouts.reference_bytes(setup, state.params)
  held = sharding.per_device_bytes(state) + sharding.per_device_bytes(setup.batch) + beside
  per_logit = BYTES_PER_LOGIT.get(_platform(setup), max(BYTES_PER_LOGIT.values())) / 4
  after = lambda n: next(c for c in candidates if c > n)
  # Hopeless: the state, the batch and one chunk's float32 logits alone pass the budget.
  n = next((c for c in candidates if held + logit_bytes(setup, c) <= budget), most)
  peaks, said = {}, []
  while True:
    chosen = _at(setup, n)
    train = _compile(chosen, 'train')
    if train.refusal and train.needed is None:  # Not for memory: not this count.
      said.append(f'{n} chunk(s) refused ({train.refusal})')
      if n == most:
        return chosen, _choice(setup, n, 'the most auto takes; ' + '; '.join(said), peaks,
                               {'train': train})
      n = after(n)
      continue
    if train.peak is None:
      return setup, _choice(setup, most, 'no memory analysis of the compiled step on '
                            f'{_platform(setup)}: the memory-lean rule', peaks)
    peaks[n] = train.peak + beside
    tried = f'; {_tried(peaks, n)} did not' if len(peaks) > 1 else ''
    if peaks[n] <= budget:
      evaluate = _compile(chosen, 'eval')
      fits = 'whole logits' if n == 1 else 'the fewest that fit'
      if evaluate.peak is None or evaluate.peak <= budget or n == most:
        return chosen, _choice(setup, n, f"{fits}: the train step's peak "
                               f'{memory.size_text(peaks[n])} fits in {where}{tried}',
                               peaks, {'train': train, 'eval': evaluate})
      said.append(f'{n} chunk(s): the eval step\'s peak {memory.size_text(evaluate.peak)} '
                  'did not fit')
      n = after(n)
      continue
    if n == most:
      return chosen, _choice(setup, n, f"the most auto takes: the train step's peak "
                             f'{memory.size_text(peaks[n])} passes {where}{tried}', peaks,
                             {'train': train})
    other = peaks[n] - per_logit * logit_bytes(setup, n)  # The step's other memory, measured.
    n = next((c for c in candidates if c > n
              and other + per_logit * logit_bytes(setup, c) <= budget), most)


def _tried(peaks: dict, chosen: int) -> str:
  return ', '.join(f'{n} chunk(s) ({memory.size_text(p)})' for n, p in sorted(peaks.items())
                   if n != chosen)


def _compile(setup: setup_lib.Setup, step: str) -> memory.Compiled:
  """The `step` ('train' or 'eval') of `setup` compiled for its devices."""
  with setup.scope():
    state = setup.abstract_state()
    if step == 'train':
      return memory.compile_step(_platform(setup), setup.jit_train_step(), state, setup.batch)
    return memory.compile_step(_platform(setup), setup.jit_eval_step(), state,
                               setup.eval_batch())


def _at(setup: setup_lib.Setup, chunks: int) -> setup_lib.Setup:
  """`setup` with model.loss_chunks=`chunks` (its model, programs and config)."""
  if setup.model.loss_chunks == chunks:
    return setup
  config = setup.config.copy_and_resolve_references()
  config.model.loss_chunks = chunks
  built = setup_lib.build(config, setup.dataset, mesh=setup.mesh, rules=setup.rules)
  return dataclasses.replace(built, choice_tasks=setup.choice_tasks)


def _choice(setup: setup_lib.Setup, chunks: int, reason: str, peaks: Optional[dict] = None,
            compiled: Optional[dict] = None) -> Choice:
  length = setup.batch['inputs'].shape[-1]
  return Choice(chunks, length // chunks, logit_bytes(setup, chunks), reason, peaks or {},
                compiled or {})


def _platform(setup: setup_lib.Setup) -> str:
  return setup.mesh.devices.flat[0].platform


def _agreed(value: Optional[int], pick) -> Optional[int]:
  """`pick` (min or max) of every process's `value`; None if any process has none. One
  collective where there are several processes (every process calls it)."""
  if jax.process_count() == 1:
    return value
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  values = multihost_utils.process_allgather(np.int64(-1 if value is None else value))
  return None if (values < 0).any() else int(pick(values))
