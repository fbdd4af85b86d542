"""Rollouts (zoo.models.decode.rollout): completions from the live, sharded parameters, each
row stopping at its stop ids, with the log-probability of every drawn token."""
import functools

import jax
import numpy as np
import pytest

from conftest import trainer
from zoo.models import decode

TOKENS = 12
TEMPERATURE = 0.7


@pytest.fixture(scope='module')
def lm(devices):
  """char_lm's smoke model on a (4, 2) mesh, 8 left-padded prompts of 3-6 tokens, and the
  rollout without stop ids."""
  del devices
  t = trainer('char_lm', **{'mesh.shape': (4, 2)})
  lengths = np.array([3, 6, 4, 5, 6, 3, 5, 4])
  rng = np.random.default_rng(0)
  prompts = np.zeros((8, 6), np.int32)
  for b, n in enumerate(lengths):
    prompts[b, 6 - n:] = rng.integers(1, t.model.vocab_size, n)
  pad = (6 - lengths).astype(np.int32)
  with t.scope():
    roll = jax.jit(functools.partial(decode.rollout, t.model, num_tokens=TOKENS,
                                     temperature=TEMPERATURE),
                   static_argnames=('stop_ids', 'shards'))
    free = jax.device_get(roll(t.initial.params, prompts, pad, rng=jax.random.key(1)))
  return t, prompts, pad, roll, free


def test_without_stops_every_row_runs_to_the_end_with_generate_cacheds_tokens(lm):
  t, prompts, pad, _, free = lm
  with t.scope():
    want = jax.jit(functools.partial(decode.generate_cached, t.model, num_tokens=TOKENS,
                                     temperature=TEMPERATURE))(
                                         t.initial.params, prompts, pad, rng=jax.random.key(1))
  np.testing.assert_array_equal(free['tokens'], np.asarray(want)[:, 6:])
  assert free['mask'].all() and free['truncated'].all() and int(free['steps']) == TOKENS
  np.testing.assert_array_equal(free['lengths'], [TOKENS] * 8)


def test_log_probs_are_the_models_own_at_the_temperature(lm):
  """Each drawn token's log-probability from the cache equals a forward pass over prompt +
  completion (padding as segment 0, positions counted from each row's first token): what
  a training step recomputes."""
  t, prompts, pad, _, free = lm
  tokens = np.concatenate([prompts, free['tokens']], 1)
  segments = (np.arange(tokens.shape[1])[None] >= pad[:, None]).astype(np.int32)
  positions = np.maximum(np.cumsum(segments, 1) - 1, 0).astype(np.int32)
  with t.scope():
    logits = jax.jit(lambda p: t.model.apply({'params': p}, tokens, segments_BL=segments,
                                             positions_BL=positions))(t.initial.params)
  logp = jax.nn.log_softmax(np.asarray(logits, np.float32)[:, 5:-1] / TEMPERATURE, -1)
  want = np.take_along_axis(np.asarray(logp), free['tokens'][..., None], -1)[..., 0]
  np.testing.assert_allclose(free['logps'], want, atol=2e-5)
  assert (free['logps'] < 0).all()


def test_rows_stop_at_their_stop_ids_and_the_batch_when_all_have(lm):
  t, prompts, pad, roll, free = lm
  stop = int(free['tokens'][0, 2])  # Row 0 draws it by its third token.
  with t.scope():
    got = jax.device_get(roll(t.initial.params, prompts, pad, rng=jax.random.key(1),
                              stop_ids=(stop,)))
  for b in range(8):  # The same keys draw the same tokens up to each row's stop.
    hits = np.flatnonzero(free['tokens'][b] == stop)
    length = hits[0] + 1 if len(hits) else TOKENS
    assert got['lengths'][b] == length and got['truncated'][b] == (not len(hits)), b
    np.testing.assert_array_equal(got['tokens'][b, :length], free['tokens'][b, :length])
    np.testing.assert_array_equal(got['mask'][b], np.arange(TOKENS) < length)
    assert not got['tokens'][b, length:].any() and not got['logps'][b, length:].any()
    np.testing.assert_allclose(got['logps'][b, :length], free['logps'][b, :length], atol=1e-6)
  assert int(got['steps']) == max(got['lengths'])
  with t.scope():  # Every token a stop: each row ends at its first, after one step.
    first = jax.device_get(roll(t.initial.params, prompts, pad, rng=jax.random.key(1),
                                stop_ids=tuple(range(t.model.vocab_size))))
  assert int(first['steps']) == 1 and (first['lengths'] == 1).all()
  assert not first['truncated'].any()
  np.testing.assert_array_equal(first['tokens'][:, 0], free['tokens'][:, 0])


def test_each_shards_rows_narrow_by_quarters_else_halves():
  assert decode.narrowing(128) == [128, 32, 8, 2, 1]
  assert decode.narrowing(8) == [8, 2, 1] and decode.narrowing(2) == [2, 1]
  assert decode.narrowing(12) == [12, 3] and decode.narrowing(7) == [7]


@pytest.mark.parametrize('shards', [1, 4])
def test_rows_that_are_done_leave_the_batch_and_the_rest_draw_what_they_would_have(lm, shards):
  """With a third of the ids as stop ids most rows stop within a few tokens: each batch
  shard's block of rows narrows (8 rows: 8, then 2, then 1; on the mesh's 4 batch shards
  blocks of 2, then 1) and the model runs fewer rows x steps, while every row still draws
  its own tokens, as in the full batch, up to its stop."""
  t, prompts, pad, roll, free = lm
  stops = tuple(range(1, t.model.vocab_size, 3))
  with t.scope():
    got = jax.device_get(roll(t.initial.params, prompts, pad, rng=jax.random.key(1),
                              stop_ids=stops, shards=shards))
  assert int(free['row_steps']) == 8 * (TOKENS - 1)
  lengths = got['lengths']
  assert int(got['steps']) == max(lengths) and min(lengths) < max(lengths) / 4, lengths
  # Each step runs every block at the narrowest width that holds its busiest block's rows
  # still drawing.
  widths = {1: (8, 2, 1), 4: (2, 1)}[shards]
  want_row_steps = sum(
      shards * min(w for w in widths if w >= (lengths > step).reshape(shards, -1).sum(1).max())
      for step in range(1, int(got['steps'])))
  assert int(got['row_steps']) == want_row_steps < 8 * (int(got['steps']) - 1)
  for b in range(8):
    hits = np.flatnonzero(np.isin(free['tokens'][b], stops))
    assert lengths[b] == (hits[0] + 1 if len(hits) else TOKENS), b
    np.testing.assert_array_equal(got['tokens'][b, :lengths[b]], free['tokens'][b, :lengths[b]])
    np.testing.assert_allclose(got['logps'][b, :lengths[b]], free['logps'][b, :lengths[b]],
                               atol=1e-6)
