"""Autoregressive decoding for decoder LMs: the sampling rule, and two ways to produce tokens.

- `rollout`: prefill the prompts once, then one token per step from a key/value cache (the
  model with `decode=True`; the cache is sharded over heads like attention's
  activations), each row stopping at its stop ids and the loop when all have, with each
  drawn token's log-probability: what post-training samples from its live parameters.
  Prompts of different lengths are left-padded: each row's positions and its cache mask
  start after its padding. Needs prompt + new tokens <= the model's max_len.
  `generate_cached` is rollout's tokens after the prompts, every row running to the end.
- `generate`: recompute the whole window for every token, sliding past max_len; what the
  trainer's eval sample uses, and the fallback for samples longer than max_len.

All draw token t with the key fold_in(rng, t) (t its position in the output), so given
the same logits they pick the same tokens: greedily (temperature 0), or by sampling among
the `top_k` likeliest and the smallest set of likeliest tokens whose probability reaches
`top_p`. Jit them with the sampling settings static.
"""
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp


def choose(logits_BV: jax.Array, rng: jax.Array, temperature: float = 1.0, top_k: int = 0,
           top_p: float = 1.0) -> jax.Array:
  """The next token of each row: argmax at temperature 0, else a sample of the filtered
  distribution."""
  if temperature == 0:
    return jnp.argmax(logits_BV, axis=-1)
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
  return jax.random.categorical(rng, logits_BV)


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


def rollout(model: nn.Module, params: dict, prompts_BP: jax.Array, pad_B: jax.Array,
            num_tokens: int, rng: jax.Array, temperature: float = 1.0, top_k: int = 0,
            top_p: float = 1.0, stop_ids: tuple[int, ...] = ()) -> dict:
  """Completions of left-padded prompts (pad_B tokens of padding each) from a key/value
  cache: one prefill, then one token per step for every row until each row has drawn one
  of `stop_ids` (kept, as its last token) or `num_tokens` tokens; the loop ends when
  every row is done, so a batch that stops early costs only the steps it ran. Shapes are
  fixed by (batch, prompt length, num_tokens): one program for a whole run.

  Returns a dict of arrays: 'tokens' [B, N] (0 past a row's end), 'logps' [B, N] float32
  (each drawn token's log-probability at `temperature`: token_logps; 0 past the end),
  'mask' [B, N] int32 (1 on a row's completion, its stop token included), 'lengths' [B],
  'truncated' [B] bool (no stop id drawn: ran out of tokens) and 'steps' (the tokens the
  loop drew per row, at most N). Token t of a row is drawn with key fold_in(rng, P + t),
  as generate_cached's, so without stop ids the tokens are generate_cached's."""
  batch, prompt_len = prompts_BP.shape
  # The cache holds this call's tokens only: each step attends over prompt + budget slots,
  # not the model's max_len.
  decoder = model.clone(decode=True, cache_length=prompt_len + num_tokens)
  stops = jnp.asarray(stop_ids or (-1,), jnp.int32)
  positions_BP = jnp.maximum(jnp.arange(prompt_len)[None, :] - pad_B[:, None], 0)
  logits_BPV, state = decoder.apply({'params': params}, prompts_BP, positions_BL=positions_BP,
                                    start_B=pad_B, mutable=['cache'])

  def draw(t, logits_BV, carry):
    """Token t of every row not yet done, its log-prob, and who is done after it."""
    tokens_BN, logps_BN, done_B = carry
    next_B = choose(logits_BV, jax.random.fold_in(rng, prompt_len + t), temperature, top_k,
                    top_p).astype(jnp.int32)
    logp_B = token_logps(logits_BV, next_B, temperature)
    tokens_BN = tokens_BN.at[:, t].set(jnp.where(done_B, 0, next_B))
    logps_BN = logps_BN.at[:, t].set(jnp.where(done_B, 0.0, logp_B))
    return tokens_BN, logps_BN, done_B | jnp.isin(next_B, stops)

  first = (jnp.zeros((batch, num_tokens), jnp.int32), jnp.zeros((batch, num_tokens), jnp.float32),
           jnp.zeros((batch,), bool))
  first = draw(0, logits_BPV[:, -1], first)

  def cond(carry):
    t, (_, _, done_B), _ = carry
    return (t < num_tokens) & ~done_B.all()

  def body(carry):
    t, drawn, cache = carry
    token_B1 = jax.lax.dynamic_slice_in_dim(drawn[0], t - 1, 1, axis=1)
    positions_B1 = (prompt_len + t - 1 - pad_B)[:, None]
    logits_B1V, state = decoder.apply({'params': params, 'cache': cache}, token_B1,
                                      positions_BL=positions_B1, start_B=pad_B, mutable=['cache'])
    return t + 1, draw(t, logits_B1V[:, 0], drawn), state['cache']
  steps, (tokens_BN, logps_BN, done_B), _ = jax.lax.while_loop(
      cond, body, (jnp.asarray(1, jnp.int32), first, state['cache']))
  # A row's tokens run to its stop id (included): the first one, or all N.
  stopped_BN = jnp.isin(tokens_BN, stops) & (jnp.arange(num_tokens) < steps)[None, :]
  lengths_B = jnp.where(stopped_BN.any(axis=1), jnp.argmax(stopped_BN, axis=1) + 1, steps)
  mask_BN = (jnp.arange(num_tokens)[None, :] < lengths_B[:, None]).astype(jnp.int32)
  return {'tokens': tokens_BN * mask_BN, 'logps': logps_BN * mask_BN, 'mask': mask_BN,
          'lengths': lengths_B, 'truncated': ~done_B, 'steps': steps}


def generate_cached(model: nn.Module, params: dict, prompts_BP: jax.Array, pad_B: jax.Array,
                    num_tokens: int, rng: jax.Array, temperature: float = 1.0, top_k: int = 0,
                    top_p: float = 1.0) -> jax.Array:
  """[B, P + num_tokens]: the prompts (left-padded by pad_B tokens each) and what follows,
  from a key/value cache (rollout without stop ids: every row runs num_tokens)."""
  out = rollout(model, params, prompts_BP, pad_B, num_tokens, rng, temperature, top_k, top_p)
  return jnp.concatenate([prompts_BP, out['tokens'].astype(prompts_BP.dtype)], axis=1)
