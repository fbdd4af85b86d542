"""Autoregressive decoding for decoder LMs: the sampling rule, and two ways to produce tokens.

- `generate_cached`: prefill the prompts once, then one token per step from a key/value
  cache (the model with `decode=True`; the cache is sharded over heads like attention's
  activations). Prompts of different lengths are left-padded: each row's positions and
  its cache mask start after its padding. Needs prompt + new tokens <= the model's max_len.
- `generate`: recompute the whole window for every token, sliding past max_len; what the
  trainer's eval sample uses, and the fallback for samples longer than max_len.

Both draw token t with the key fold_in(rng, t) (t its position in the output), so given
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


def generate_cached(model: nn.Module, params: dict, prompts_BP: jax.Array, pad_B: jax.Array,
                    num_tokens: int, rng: jax.Array, temperature: float = 1.0, top_k: int = 0,
                    top_p: float = 1.0) -> jax.Array:
  """[B, P + num_tokens]: the prompts (left-padded by pad_B tokens each) and what follows,
  from a key/value cache: one prefill of P tokens, then num_tokens - 1 single-token steps."""
  decoder = model.clone(decode=True)
  batch, prompt_len = prompts_BP.shape
  positions_BP = jnp.maximum(jnp.arange(prompt_len)[None, :] - pad_B[:, None], 0)
  logits_BPV, state = decoder.apply({'params': params}, prompts_BP, positions_BL=positions_BP,
                                    start_B=pad_B, mutable=['cache'])
  tokens_BT = jnp.concatenate(
      [prompts_BP, jnp.zeros((batch, num_tokens), prompts_BP.dtype)], axis=1)
  first_B = choose(logits_BPV[:, -1], jax.random.fold_in(rng, prompt_len), temperature, top_k,
                   top_p)
  tokens_BT = tokens_BT.at[:, prompt_len].set(first_B.astype(tokens_BT.dtype))

  def body(t, carry):
    tokens_BT, cache = carry
    token_B1 = jax.lax.dynamic_slice_in_dim(tokens_BT, t - 1, 1, axis=1)
    positions_B1 = (t - 1 - pad_B)[:, None]
    logits_B1V, state = decoder.apply({'params': params, 'cache': cache}, token_B1,
                                      positions_BL=positions_B1, start_B=pad_B, mutable=['cache'])
    next_B = choose(logits_B1V[:, 0], jax.random.fold_in(rng, t), temperature, top_k, top_p)
    return tokens_BT.at[:, t].set(next_B.astype(tokens_BT.dtype)), state['cache']
  tokens_BT, _ = jax.lax.fori_loop(prompt_len + 1, prompt_len + num_tokens, body,
                                   (tokens_BT, state['cache']))
  return tokens_BT
