"""A decoder-only Transformer language model (GPT-style, pre-norm).

References: Vaswani et al., 2017 (arXiv:1706.03762); Radford et al., 2019 (GPT-2).
The layers and their switches (scan, remat, bf16, dropout, rotary) are in
zoo.models.transformer. Shapes are suffixed: B batch, L length, D d_model, V padded vocab.
"""
from typing import Optional, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from zoo.errors import fail
from zoo.models import layers, transformer
from zoo.models.family import ModelFamily


class TransformerLM(transformer.Transformer, kw_only=True):
  """Token ids [B, L] -> next-token logits [B, L, padded vocab] in float32 (or, given the
  targets, each one's loss: what training and evaluation ask for).

  GPT-2 is learned positions, LayerNorm, 'gelu', use_bias and tie_embeddings; Llama is
  rotary positions, 'rms', 'swiglu', num_kv_heads and an untied head; Mistral, Qwen and
  Gemma add the switches of zoo.models.transformer (zoo.hf.layouts).
  """
  vocab_size: int
  max_len: int
  positions: str = 'learned'
  tie_embeddings: bool = False   # The output head is the embedding table, transposed.
  loss_chunks: int = 0           # With targets: the loss's chunks of the sequence; 0: auto.

  @nn.compact
  def __call__(self, tokens_BL: jax.Array, train: bool = False,
               positions_BL: Optional[jax.Array] = None,
               start_B: Optional[jax.Array] = None,
               segments_BL: Optional[jax.Array] = None,
               targets_BL: Optional[jax.Array] = None) -> Union[jax.Array, dict]:
    """Packed documents (zoo.data.packing) give each token's `segments_BL` and its position
    in its document (`positions_BL`). With `decode=True`, `positions_BL` are the tokens'
    positions and `start_B` each row's first cache position (left padding before it); see
    zoo.models.decode. With `targets_BL`, no logits: each target's loss and whether it is
    the likeliest token, computed `loss_chunks` at a time (layers.token_losses)."""
    embed_VD = layers.embedding_table(self, self.vocab_size, self.d_model, self.dtype)
    x_BLD = transformer.embed_tokens(self, embed_VD, tokens_BL)
    if self.embed_scale:  # Gemma: sqrt(d_model), in the computation dtype as HF rounds it.
      x_BLD = x_BLD * jnp.asarray(np.float32(self.d_model) ** np.float32(0.5), x_BLD.dtype)
    # Tests take gradients with respect to the embedded inputs here (see transformer_test.py).
    x_BLD = self.perturb('embedded', x_BLD)
    x_BLD = transformer.embed_positions(self, x_BLD, self.positions, self.max_len, 'pos_embed',
                                        train, positions_BL)
    x_BLD = transformer.blocks(self, x_BLD, prefix='block', train=train, causal=True,
                               rotary=self.positions == 'rotary', positions_BL=positions_BL,
                               start_B=start_B, segments_BL=segments_BL,
                               cache_length=self.max_len)
    x_BLD = transformer.norm(self, 'ln_final')(x_BLD)
    tied = embed_VD if self.tie_embeddings else None
    if targets_BL is not None:
      return layers.token_losses(self, x_BLD, targets_BL, self.vocab_size, self.dtype, tied,
                                 self.final_softcap, self.loss_chunks)
    return layers.vocab_logits(self, x_BLD, self.vocab_size, self.dtype, tied,
                               self.final_softcap)


def train_flops(model: TransformerLM, batch_size: int, seq_len: int) -> int:
  """Analytic train-step FLOPs (zoo.run.perf's conventions): 6 N tokens + 12 layers len
  (heads x head size) tokens, N the parameters of the matmuls (blocks and output head)."""
  d, f, h = model.d_model, model.mlp_dim, model.head_size
  attention = d * h * (2 * model.num_heads + 2 * model.kv_heads)  # q, out; k, v.
  mlp = (3 if model.mlp_activation == 'swiglu' else 2) * d * f
  matmul_params = (model.num_layers * (attention + mlp)
                   + d * layers.padded_vocab_size(model.vocab_size))
  tokens = batch_size * seq_len
  return (6 * matmul_params * tokens
          + 12 * model.num_layers * seq_len * model.num_heads * h * tokens)


def check_inputs(m, inputs) -> None:
  """max_len covers the data, and model.loss_chunks divides its sequence length."""
  transformer.check_lengths(m, inputs)
  length = inputs[0].shape[1]
  if m.get('loss_chunks') and length % m.loss_chunks:
    fail('model.loss_chunks', f'{m.loss_chunks} does not divide the sequence length {length}; '
         'give a divisor, or 0 (auto)')


FAMILY = ModelFamily(TransformerLM, task='lm', check_config=transformer.check_config,
                     check_inputs=check_inputs, analytic_flops=train_flops)
