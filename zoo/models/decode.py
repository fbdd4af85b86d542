"""Autoregressive decoding for decoder LMs: the sampling rule, and two ways to produce tokens.

- `rollout`: prefill the prompts once, then one token per step from a key/value cache (the
  model with `decode=True`; the cache is sharded over heads like attention's
  activations), each row stopping at its stop ids, done rows leaving the batch and the
  loop ending when all are done, with each drawn token's log-probability: what
  post-training samples from its live parameters.
  Prompts of different lengths are left-padded: each row's positions and its cache mask
  start after its padding. Needs prompt + new tokens <= the model's max_len.
  `generate_cached` is rollout's tokens after the prompts, every row running to the end.
- `generate`: recompute the whole window for every token, sliding past max_len; what the
  trainer's eval sample uses, and the fallback for samples longer than max_len.

All draw token t of row b with the key fold_in(fold_in(rng, t), b) (t its position in the
output), so given the same logits they pick the same tokens: greedily (temperature 0), or
by sampling among the `top_k` likeliest and the smallest set of likeliest tokens whose
probability reaches `top_p`. Jit them with the sampling settings static.
"""
from typing import Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp


def first_max(x_BV: jax.Array) -> jax.Array:
  """jnp.argmax over the last axis (the first of equal largest), as two plain reductions:
  argmax's variadic reduce is 2-3x slower on CPU, once per decoding step."""
  size = x_BV.shape[-1]
  top_B1 = x_BV.max(axis=-1, keepdims=True)
  first_B = jnp.min(jnp.where(x_BV == top_B1, jnp.arange(size, dtype=jnp.int32), size), axis=-1)
  return jnp.minimum(first_B, size - 1)  # NaN logits: the last id rather than out of range.


def choose(logits_BV: jax.Array, rng: jax.Array, temperature: float = 1.0, top_k: int = 0,
           top_p: float = 1.0, rows_B: Optional[jax.Array] = None) -> jax.Array:
  """The next token of each row: argmax at temperature 0, else a sample of the filtered
  distribution (the Gumbel-max draw of jax.random.categorical). Row b's noise comes from
  fold_in(rng, rows_B[b]) (default: b), so a row draws the same token whichever batch,
  position or device holds it."""
  if temperature == 0:
    return first_max(logits_BV)
  logits_BV = logits_BV.astype(jnp.float32) / temperature
  if top_k:
    kth_B1 = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
    logits_BV = jnp.where(logits_BV < kth_B1, -1e30, logits_BV)
  if top_p < 1:
    sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV  # Probability of the likelier ones.
    cutoff_B1 = jnp.min(jnp.where(before_BV < top_p, sorted_BV, jnp.inf), axis=-1, keepdims=True)
    logits_BV = jnp.where(logits_BV < cutoff_B1, -1e30, logits_BV)
  if rows_B is None:
    rows_B = jnp.arange(logits_BV.shape[0])
  noise_BV = jax.vmap(lambda row: jax.random.gumbel(
      jax.random.fold_in(rng, row), logits_BV.shape[1:], jnp.float32))(rows_B)
  return first_max(logits_BV + noise_BV)


def generate(apply_fn: Callable, variables: dict, tokens_BT: jax.Array, prompt_len: int,
             rng: jax.Array, window: int, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0) -> jax.Array:
  """Fills tokens_BT[:, prompt_len:] one token at a time, recomputing the last `window`
  tokens (the model's max_len; beyond it the context slides)."""
  total = tokens_BT.shape[1]
  window = min(window, total)

  def body(t, tokens_BT):
    start = jnp.clip(t - window, 0, total - window)
    context_BW = jax.lax.dynamic_slice_in_dim(tokens_BT, start, window, axis=1)
    logits_BWV = apply_fn(variables, context_BW)
    logits_BV = jax.lax.dynamic_index_in_dim(logits_BWV, t - 1 - start, axis=1, keepdims=False)
    next_B = choose(logits_BV, jax.random.fold_in(rng, t), temperature, top_k, top_p)
    return tokens_BT.at[:, t].set(next_B.astype(tokens_BT.dtype))
  return jax.lax.fori_loop(prompt_len, total, body, tokens_BT)


def token_logps(logits_BV: jax.Array, tokens_B: jax.Array, temperature: float) -> jax.Array:
  """log p(token) of each row under softmax(logits / temperature) (temperature 0: the
  logits as they are), in float32: the sampling distribution before top-k and top-p, as
  the policy's log-probs are computed again in training."""
  logits_BV = logits_BV.astype(jnp.float32)
  if temperature:
    logits_BV = logits_BV / temperature
  logp_BV = jax.nn.log_softmax(logits_BV, axis=-1)
  return jnp.take_along_axis(logp_BV, tokens_B[:, None].astype(jnp.int32), axis=-1)[:, 0]


def _narrow(x: jax.Array, axis: int, order_SM: jax.Array) -> jax.Array:
  """x's rows (along `axis`, in `shards` consecutive blocks, one per batch shard) that
  order_SM [shards, M] picks within each block: rows never cross shards (a gather across
  them would assemble the whole batch on every device)."""
  shards, narrower = order_SM.shape
  x = x.reshape(x.shape[:axis] + (shards, -1) + x.shape[axis + 1:])
  index = order_SM.reshape((1,) * axis + (shards, narrower) + (1,) * (x.ndim - axis - 2))
  x = jnp.take_along_axis(x, index, axis=axis + 1)
  return x.reshape(x.shape[:axis] + (shards * narrower,) + x.shape[axis + 2:])


def _narrow_cache(cache: dict, order_SM: jax.Array) -> dict:
  """The cache's keys and values narrowed (their batch axis is the fourth from last:
  after the layers' under nn.scan); write indices as they are."""
  def take(path, x):
    if path[-1].key in ('key', 'value'):
      return _narrow(x, x.ndim - 4, order_SM)
    return x
  return jax.tree_util.tree_map_with_path(take, cache)


NARROWING = 4  # Each narrower batch a quarter as wide: few loops to compile (one each).


def narrowing(rows: int) -> list[int]:
  """The widths one shard's `rows` of a rollout narrow through: each a quarter of the one
  before, else a half, down to 1."""
  widths = [rows]
  while widths[-1] % 2 == 0:
    width = widths[-1]
    widths.append(width // NARROWING if width % NARROWING == 0 else width // 2)
  return widths


def rollout(model: nn.Module, params: dict, prompts_BP: jax.Array, pad_B: jax.Array,
            num_tokens: int, rng: jax.Array, temperature: float = 1.0, top_k: int = 0,
            top_p: float = 1.0, stop_ids: tuple[int, ...] = (), shards: int = 1) -> dict:
  """Completions of left-padded prompts (pad_B tokens of padding each) from a key/value cache:
  one prefill, then one token per step for every row until each row has drawn one of
  `stop_ids` (kept, as its last token) or `num_tokens` tokens; the loop ends when every
  row is done. Rows that are done leave the batch: the batch is `shards` blocks of rows
  (its shards over the mesh), and once every block's rows still drawing fit a block a
  quarter as wide (`narrowing`), they and their cache move into it, within their shard,
  down to one row per shard, so a long tail costs only its own rows. Shapes are fixed by
  (batch, prompt length, num_tokens): one program for a whole run.

  Returns a dict of arrays: 'tokens' [B, N] (0 past a row's end), 'logps' [B, N] float32
  (each drawn token's log-probability at `temperature`: token_logps; 0 past the end),
  'mask' [B, N] int32 (1 on a row's completion, its stop token included), 'lengths' [B],
  'truncated' [B] bool (no stop id drawn: ran out of tokens), 'steps' (the tokens the loop
  drew per row, at most N) and 'row_steps' (rows x steps the model ran after the prefill:
  B x (steps - 1) without narrowing). Token t of row b is drawn with key fold_in(rng, P +
  t) and row b (choose), as generate_cached's, whatever width the batch has by then:
  without stop ids the tokens are generate_cached's, with them each row's are the same up
  to its stop."""
  batch, prompt_len = prompts_BP.shape
  pad_B = jnp.asarray(pad_B)
  # The cache holds this call's tokens only: each step attends over prompt + budget slots,
  # not the model's max_len.
  decoder = model.clone(decode=True, cache_length=prompt_len + num_tokens)
  stops = jnp.asarray(stop_ids or (-1,), jnp.int32)
  positions_BP = jnp.maximum(jnp.arange(prompt_len)[None, :] - pad_B[:, None], 0)
  logits_B1V, state = decoder.apply({'params': params}, prompts_BP, positions_BL=positions_BP,
                                    start_B=pad_B, last=True, mutable=['cache'])

  def draw(t, logits_WV, rows_W, drawn):
    """Token t of the rows `rows_W` not yet done, its log-prob, and who is done after it."""
    tokens_BN, logps_BN, done_B = drawn
    done_W = done_B[rows_W]
    next_W = choose(logits_WV, jax.random.fold_in(rng, prompt_len + t), temperature, top_k,
                    top_p, rows_W).astype(jnp.int32)
    logp_W = token_logps(logits_WV, next_W, temperature)
    return (tokens_BN.at[rows_W, t].set(jnp.where(done_W, 0, next_W)),
            logps_BN.at[rows_W, t].set(jnp.where(done_W, 0.0, logp_W)),
            done_B.at[rows_W].set(done_W | jnp.isin(next_W, stops)))

  rows_B = jnp.arange(batch)
  drawn = (jnp.zeros((batch, num_tokens), jnp.int32), jnp.zeros((batch, num_tokens), jnp.float32),
           jnp.zeros((batch,), bool))
  drawn = draw(0, logits_B1V[:, -1], rows_B, drawn)

  def body(carry):
    t, drawn, cache, rows_W, pad_W = carry
    token_W1 = drawn[0][rows_W, t - 1][:, None]
    positions_W1 = (prompt_len + t - 1 - pad_W)[:, None]
    logits_W1V, state = decoder.apply({'params': params, 'cache': cache}, token_W1,
                                      positions_BL=positions_W1, start_B=pad_W, mutable=['cache'])
    return t + 1, draw(t, logits_W1V[:, 0], rows_W, drawn), state['cache'], rows_W, pad_W

  # Each shard narrows its own rows (no stops: none end early, one width).
  narrows = bool(stop_ids) and batch % shards == 0  # Else rows stay where they are.
  shards = shards if narrows else 1
  local = narrowing(batch // shards) if narrows else [batch]
  carry = (jnp.asarray(1, jnp.int32), drawn, state['cache'], rows_B, pad_B)
  row_steps = jnp.asarray(0, jnp.int32)
  for width, narrower in zip(local, local[1:] + [0]):
    if width < local[0]:  # Each shard's rows still drawing first, then done ones to fill.
      t, drawn, cache, rows_W, pad_W = carry
      order_SM = jnp.argsort(drawn[2][rows_W].reshape(shards, -1), axis=1, stable=True)[:, :width]
      carry = (t, drawn, _narrow_cache(cache, order_SM), _narrow(rows_W, 0, order_SM),
               _narrow(pad_W, 0, order_SM))

    def cond(carry, narrower=narrower):
      t, (_, _, done_B), _, rows_W, _ = carry
      drawing_S = (~done_B[rows_W]).reshape(shards, -1).sum(axis=1)
      return (t < num_tokens) & (drawing_S.max() > narrower)
    start = carry[0]
    carry = jax.lax.while_loop(cond, body, carry)
    row_steps += shards * width * (carry[0] - start)
  steps, (tokens_BN, logps_BN, done_B) = carry[:2]
  # A row's tokens run to its stop id (included): the first one, or all N.
  stopped_BN = jnp.isin(tokens_BN, stops) & (jnp.arange(num_tokens) < steps)[None, :]
  lengths_B = jnp.where(stopped_BN.any(axis=1), jnp.argmax(stopped_BN, axis=1) + 1, steps)
  mask_BN = (jnp.arange(num_tokens)[None, :] < lengths_B[:, None]).astype(jnp.int32)
  return {'tokens': tokens_BN * mask_BN, 'logps': logps_BN * mask_BN, 'mask': mask_BN,
          'lengths': lengths_B, 'truncated': ~done_B, 'steps': steps, 'row_steps': row_steps}


def generate_cached(model: nn.Module, params: dict, prompts_BP: jax.Array, pad_B: jax.Array,
                    num_tokens: int, rng: jax.Array, temperature: float = 1.0, top_k: int = 0,
                    top_p: float = 1.0) -> jax.Array:
  """[B, P + num_tokens]: the prompts (left-padded by pad_B tokens each) and what follows,
  from a key/value cache (rollout without stop ids: every row runs num_tokens)."""
  out = rollout(model, params, prompts_BP, pad_B, num_tokens, rng, temperature, top_k, top_p)
  return jnp.concatenate([prompts_BP, out['tokens'].astype(prompts_BP.dtype)], axis=1)
