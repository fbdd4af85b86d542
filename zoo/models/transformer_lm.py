"""A decoder-only Transformer language model (GPT-style, pre-norm).

References: Vaswani et al., 2017 (arXiv:1706.03762); Radford et al., 2019 (GPT-2,
pre-norm blocks); Megatron-LM (arXiv:1909.08053) for the split of heads and MLP units
over the 'model' mesh axis. Shapes are suffixed: B batch, L length, D d_model,
H heads, K head size, F MLP units, V padded vocabulary.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp

TASK = 'lm'
VOCAB_MULTIPLE = 128  # Pad the vocabulary so it splits evenly over a 'model' axis.

_init = nn.initializers.normal(stddev=0.02)


def padded_vocab_size(vocab_size):
  return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def _param(module, name, shape, axes, init=_init):
  return module.param(name, nn.with_logical_partitioning(init, axes), shape)


def _layer_norm(name):
  return nn.LayerNorm(
      name=name,
      scale_init=nn.with_logical_partitioning(nn.initializers.ones_init(), ('embed',)),
      bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), ('embed',)))


class CausalSelfAttention(nn.Module):
  """Multi-head causal self-attention with einsum projections.

  Own parameters rather than nn.DenseGeneral: flax issue #3676 breaks 3-D kernels with
  logical partitioning under a mesh.
  """
  num_heads: int
  head_dim: int

  @nn.compact
  def __call__(self, x_BLD):
    d_model = x_BLD.shape[-1]
    qkv_shape, qkv_axes = (d_model, self.num_heads, self.head_dim), ('embed', 'heads', 'kv')
    act = ('act_batch', 'act_len', 'act_heads', 'act_kv')
    q_BLHK, k_BLHK, v_BLHK = (
        nn.with_logical_constraint(
            jnp.einsum('BLD,DHK->BLHK', x_BLD, _param(self, n, qkv_shape, qkv_axes)), act)
        for n in ('query', 'key', 'value'))
    length = x_BLD.shape[1]
    logits_BHLL = jnp.einsum('BLHK,BMHK->BHLM', q_BLHK, k_BLHK) / jnp.sqrt(self.head_dim)
    causal_LL = jnp.tril(jnp.ones((length, length), dtype=bool))
    logits_BHLL = jnp.where(causal_LL, logits_BHLL.astype(jnp.float32), -1e30)
    probs_BHLL = jax.nn.softmax(logits_BHLL, axis=-1).astype(v_BLHK.dtype)
    out_BLHK = nn.with_logical_constraint(
        jnp.einsum('BHLM,BMHK->BLHK', probs_BHLL, v_BLHK), act)
    w_out = _param(self, 'out', (self.num_heads, self.head_dim, d_model), ('heads', 'kv', 'embed'))
    return jnp.einsum('BLHK,HKD->BLD', out_BLHK, w_out)


class MlpBlock(nn.Module):
  """Two-layer GELU MLP; the hidden units are split over 'model'."""
  mlp_dim: int

  @nn.compact
  def __call__(self, x_BLD):
    d_model = x_BLD.shape[-1]
    h_BLF = jnp.einsum('BLD,DF->BLF', x_BLD, _param(self, 'wi', (d_model, self.mlp_dim), ('embed', 'mlp')))
    h_BLF = nn.with_logical_constraint(nn.gelu(h_BLF), ('act_batch', 'act_len', 'act_mlp'))
    return jnp.einsum('BLF,FD->BLD', h_BLF, _param(self, 'wo', (self.mlp_dim, d_model), ('mlp', 'embed')))


class Block(nn.Module):
  """Pre-norm residual block: attention, then MLP."""
  num_heads: int
  mlp_dim: int

  @nn.compact
  def __call__(self, x_BLD):
    d_model = x_BLD.shape[-1]
    x_BLD = x_BLD + CausalSelfAttention(self.num_heads, d_model // self.num_heads, name='attn')(
        _layer_norm('ln_attn')(x_BLD))
    x_BLD = x_BLD + MlpBlock(self.mlp_dim, name='mlp')(_layer_norm('ln_mlp')(x_BLD))
    return nn.with_logical_constraint(x_BLD, ('act_batch', 'act_len', 'act_embed'))


class TransformerLM(nn.Module):
  """Token ids [B, L] -> next-token logits [B, L, padded vocab]; padded ids get -inf."""
  vocab_size: int
  num_layers: int
  d_model: int
  num_heads: int
  mlp_dim: int
  max_len: int

  @nn.compact
  def __call__(self, tokens_BL):
    vocab = padded_vocab_size(self.vocab_size)
    length = tokens_BL.shape[1]
    embed_VD = _param(self, 'embed', (vocab, self.d_model), ('vocab', 'embed'))
    pos_LD = _param(self, 'pos_embed', (self.max_len, self.d_model), ('len', 'embed'))
    x_BLD = jnp.take(embed_VD, tokens_BL, axis=0) + pos_LD[:length]
    x_BLD = nn.with_logical_constraint(x_BLD, ('act_batch', 'act_len', 'act_embed'))
    for i in range(self.num_layers):
      x_BLD = Block(self.num_heads, self.mlp_dim, name=f'block_{i}')(x_BLD)
    x_BLD = _layer_norm('ln_final')(x_BLD)
    logits_BLV = jnp.einsum('BLD,DV->BLV', x_BLD,
                            _param(self, 'head', (self.d_model, vocab), ('embed', 'vocab')))
    logits_BLV = nn.with_logical_constraint(logits_BLV, ('act_batch', 'act_len', 'act_vocab'))
    return jnp.where(jnp.arange(vocab) < self.vocab_size, logits_BLV, -1e30)


def generate(apply_fn, params, tokens_BL, prompt_len, rng, temperature=1.0):
  """Fills tokens_BL[:, prompt_len:] one token at a time; temperature 0 is greedy.

  Recomputes the whole window per token (no cache): fine for the short samples
  printed at eval time. Jit it with `prompt_len` static.
  """
  def body(t, tokens_BL):
    logits_BV = apply_fn({'params': params}, tokens_BL)[:, t - 1].astype(jnp.float32)
    if temperature == 0:
      next_B = jnp.argmax(logits_BV, axis=-1)
    else:
      next_B = jax.random.categorical(jax.random.fold_in(rng, t), logits_BV / temperature)
    return tokens_BL.at[:, t].set(next_B.astype(tokens_BL.dtype))
  return jax.lax.fori_loop(prompt_len, tokens_BL.shape[1], body, tokens_BL)
