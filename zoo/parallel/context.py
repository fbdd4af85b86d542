"""Context parallelism's load-balanced layout of a sequence.

Where the rules split the sequence over `shards` devices (a 'context' mesh axis,
zoo.parallel.sharding.context_rules), causal attention would leave the device with the
first block of positions almost idle (its queries see few keys) and the last one with most
of the work. So, as MaxText, Megatron and torchtitan do, each row is cut into 2 x shards
chunks and device i holds chunks i and 2 x shards - 1 - i: every device then has the same
number of (query, key) pairs to compute. The permutation is applied once, on the host, to
every field of a batch that runs along the sequence, and each token's position travels
with it (`positions`): attention's masks and rotary positions follow the positions, not the
order (zoo.models.attention), and the mean loss does not depend on the order, so the
numbers are those of the unpermuted batch. Where a device gathers a block held in that
order from every shard (attention's keys and values), `natural_order` puts it back.
"""
import jax
import jax.numpy as jnp
import numpy as np

from zoo.errors import fail


def balanced_order(length: int, shards: int) -> np.ndarray:
  """The positions [length] in the order the devices hold them: for each shard i in turn,
  chunk i then chunk 2 * shards - 1 - i of 2 * shards equal chunks."""
  if shards <= 1:
    return np.arange(length)
  if length % (2 * shards):
    fail('data.seq_len', f'a sequence of {length} positions does not split into 2 x {shards} '
         f'equal chunks for the {shards} devices it is split over (context parallelism, '
         f'load-balanced); use a multiple of {2 * shards}')
  chunks = np.arange(length).reshape(2 * shards, -1)
  return np.concatenate([np.concatenate([chunks[i], chunks[2 * shards - 1 - i]])
                         for i in range(shards)])


def natural_order(x: jax.Array, shards: int, axis: int) -> jax.Array:
  """`x`, whose `axis` holds a sequence in the load-balanced order (balanced_order), with
  that axis back in natural order: a reshape and a flip of the tail chunks, no gather (whose
  gradient would be a scatter)."""
  if shards <= 1:
    return x
  pairs = x.reshape(x.shape[:axis] + (shards, 2, -1) + x.shape[axis + 1:])
  heads = jax.lax.index_in_dim(pairs, 0, axis + 1, keepdims=False)  # Chunks 0..shards-1.
  tails = jnp.flip(jax.lax.index_in_dim(pairs, 1, axis + 1, keepdims=False), axis)
  return jnp.concatenate([heads, tails], axis).reshape(x.shape)


def along_sequence(shape: tuple, length: int) -> bool:
  """Whether a batch field of `shape` ([rows, ...]) runs along the `length` positions: the
  fields that `balance` permutes, and that a split sequence places in slices
  (zoo.data.feed.Placement)."""
  return len(shape) >= 2 and shape[1] == length


def balance(batch: dict, shards: int) -> dict:
  """`batch` (a language model's: inputs, targets and those of mask, segments, positions and
  bytes it has, each [rows, length]) with every field that runs along the sequence permuted
  into the balanced order, and `positions` (int32; the batch's own, packed documents', or
  0..length-1) permuted with them. `shards` <= 1: unchanged."""
  if shards <= 1:
    return batch
  rows, length = batch['inputs'].shape[:2]
  order = balanced_order(length, shards)
  out = dict(batch)
  if 'positions' not in out:
    out['positions'] = np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length))
  for name, value in out.items():
    if along_sequence(np.shape(value), length):
      out[name] = np.take(np.asarray(value), order, axis=1)
  return out
