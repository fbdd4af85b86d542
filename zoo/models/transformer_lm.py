"""A decoder-only Transformer language model (GPT-style, pre-norm).

References: Vaswani et al., 2017 (arXiv:1706.03762); Radford et al., 2019 (GPT-2).
The layers and their switches (scan, remat, bf16, dropout, rotary) are in
zoo.models.transformer. Shapes are suffixed: B batch, L length, D d_model, V padded vocab.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp

from zoo.models import layers, transformer
from zoo.models.family import ModelFamily


class TransformerLM(transformer.Transformer, kw_only=True):
  """Token ids [B, L] -> next-token logits [B, L, padded vocab] in float32."""
  vocab_size: int
  max_len: int
  positions: str = 'learned'

  @nn.compact
  def __call__(self, tokens_BL: jax.Array, train: bool = False) -> jax.Array:
    embed_VD = layers.embedding_table(self, self.vocab_size, self.d_model, self.dtype)
    x_BLD = jnp.take(embed_VD, tokens_BL, axis=0)
    # Tests take gradients with respect to the embedded inputs here (see transformer_test.py).
    x_BLD = self.perturb('embedded', x_BLD)
    x_BLD = transformer.embed_positions(self, x_BLD, self.positions, self.max_len, 'pos_embed',
                                        train)
    x_BLD = transformer.blocks(self, x_BLD, prefix='block', train=train, causal=True,
                               rotary=self.positions == 'rotary')
    x_BLD = transformer.layer_norm('ln_final', self.dtype)(x_BLD)
    return layers.vocab_logits(self, x_BLD, self.vocab_size, self.dtype)


def train_flops(model: TransformerLM, batch_size: int, seq_len: int) -> int:
  """Analytic train-step FLOPs (zoo.perf's conventions): 6 N tokens + 12 layers len d_model
  tokens, N the parameters of the matmuls (blocks and output head)."""
  d, f = model.d_model, model.mlp_dim
  matmul_params = (model.num_layers * (4 * d * d + 2 * d * f)
                   + d * layers.padded_vocab_size(model.vocab_size))
  tokens = batch_size * seq_len
  return 6 * matmul_params * tokens + 12 * model.num_layers * seq_len * d * tokens


FAMILY = ModelFamily(TransformerLM, task='lm', check_config=transformer.check_config,
                     check_inputs=transformer.check_lengths, analytic_flops=train_flops)
