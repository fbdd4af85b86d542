"""A decoder-only Transformer language model (GPT-style, pre-norm), and sampling from it.

References: Vaswani et al., 2017 (arXiv:1706.03762); Radford et al., 2019 (GPT-2).
The layers and their switches (scan, remat, bf16, dropout, rotary) are in
zoo.models.transformer. Shapes are suffixed: B batch, L length, D d_model, V padded vocab.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp

from zoo.models import transformer

TASK = 'lm'
VOCAB_MULTIPLE = 128  # Pad the vocabulary so it splits evenly over a 'model' axis.


def padded_vocab_size(vocab_size):
  return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def embedding_table(module, vocab_size, d_model, dtype):
  """The token embedding table [padded vocab, D], logical axes (vocab, embed)."""
  return transformer.param(module, 'embed', (padded_vocab_size(vocab_size), d_model),
                           ('vocab', 'embed'), dtype)


def vocab_logits(module, x_BLD, vocab_size, dtype):
  """Float32 logits over the padded vocabulary; padding ids get -1e30 (never sampled)."""
  vocab = padded_vocab_size(vocab_size)
  head_DV = transformer.param(module, 'head', (x_BLD.shape[-1], vocab), ('embed', 'vocab'), dtype)
  logits_BLV = jnp.einsum('BLD,DV->BLV', x_BLD, head_DV, preferred_element_type=jnp.float32)
  logits_BLV = nn.with_logical_constraint(logits_BLV, ('act_batch', 'act_len', 'act_vocab'))
  return jnp.where(jnp.arange(vocab) < vocab_size, logits_BLV, -1e30)


class TransformerLM(nn.Module):
  """Token ids [B, L] -> next-token logits [B, L, padded vocab] in float32."""
  vocab_size: int
  num_layers: int
  d_model: int
  num_heads: int
  mlp_dim: int
  max_len: int
  positions: str = 'learned'
  scan_layers: bool = False
  remat: str = 'none'
  dtype: str = 'float32'
  dropout_rate: float = 0.0

  @nn.compact
  def __call__(self, tokens_BL, train=False):
    embed_VD = embedding_table(self, self.vocab_size, self.d_model, self.dtype)
    x_BLD = jnp.take(embed_VD, tokens_BL, axis=0)
    x_BLD = transformer.embed_positions(self, x_BLD, self.positions, self.max_len, 'pos_embed',
                                       self.dtype)
    # Tests take gradients with respect to the embedded inputs here (see lm_test.py).
    x_BLD = self.perturb('embedded', x_BLD)
    x_BLD = nn.Dropout(self.dropout_rate)(x_BLD, deterministic=not train)
    x_BLD = nn.with_logical_constraint(x_BLD, ('act_batch', 'act_len', 'act_embed'))
    x_BLD = transformer.blocks(
        x_BLD, None, num_layers=self.num_layers, scan_layers=self.scan_layers, remat=self.remat,
        prefix='block', num_heads=self.num_heads, mlp_dim=self.mlp_dim, causal=True,
        rotary=self.positions == 'rotary', dtype=self.dtype, dropout_rate=self.dropout_rate,
        deterministic=not train)
    x_BLD = transformer.layer_norm('ln_final', self.dtype)(x_BLD)
    return vocab_logits(self, x_BLD, self.vocab_size, self.dtype)


def generate(apply_fn, variables, tokens_BT, prompt_len, rng, window, temperature=1.0, top_k=0):
  """Fills tokens_BT[:, prompt_len:] one token at a time, reading the last `window` tokens.

  temperature 0 is greedy; top_k > 0 samples among the k likeliest tokens. Beyond
  `window` (the model's max_len) the context slides. Recomputes the window per token
  (no KV cache): fine for samples of a few hundred characters. Jit it with
  `prompt_len`, `window`, `temperature` and `top_k` static.
  """
  total = tokens_BT.shape[1]
  window = min(window, total)

  def body(t, tokens_BT):
    start = jnp.clip(t - window, 0, total - window)
    context_BW = jax.lax.dynamic_slice_in_dim(tokens_BT, start, window, axis=1)
    logits_BW_V = apply_fn(variables, context_BW)
    logits_BV = jax.lax.dynamic_index_in_dim(logits_BW_V, t - 1 - start, axis=1, keepdims=False)
    if temperature == 0:
      next_B = jnp.argmax(logits_BV, axis=-1)
    else:
      logits_BV = logits_BV / temperature
      if top_k:
        kth_B1 = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
        logits_BV = jnp.where(logits_BV < kth_B1, -1e30, logits_BV)
      next_B = jax.random.categorical(jax.random.fold_in(rng, t), logits_BV)
    return tokens_BT.at[:, t].set(next_B.astype(tokens_BT.dtype))
  return jax.lax.fori_loop(prompt_len, total, body, tokens_BT)
