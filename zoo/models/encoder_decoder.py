"""An encoder-decoder Transformer (Vaswani et al., 2017, arXiv:1706.03762), pre-norm.

The encoder reads the source with bidirectional self-attention; the decoder reads the
target shifted right (teacher forcing) with causal self-attention and cross-attention to
the encoder's output. Source and target share one embedding table. The layers and their
switches are zoo.models.transformer's.
"""
import flax.linen as nn
import jax.numpy as jnp

from zoo.models import transformer
from zoo.models.transformer_lm import embedding_table, vocab_logits

TASK = 'seq2seq'


class EncoderDecoder(nn.Module):
  """(source ids [B, M], shifted target ids [B, L]) -> logits [B, L, padded vocab], float32."""
  vocab_size: int
  num_layers: int            # Per side: num_layers encoder and num_layers decoder blocks.
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
  def __call__(self, inputs_BM, decoder_inputs_BL, train=False):
    common = dict(num_layers=self.num_layers, scan_layers=self.scan_layers, remat=self.remat,
                  num_heads=self.num_heads, mlp_dim=self.mlp_dim, rotary=self.positions == 'rotary',
                  dtype=self.dtype, dropout_rate=self.dropout_rate, deterministic=not train)

    embed_VD = embedding_table(self, self.vocab_size, self.d_model, self.dtype)

    def embed(tokens, pos_name):
      x = jnp.take(embed_VD, tokens, axis=0)
      x = transformer.embed_positions(self, x, self.positions, self.max_len, pos_name, self.dtype)
      x = nn.Dropout(self.dropout_rate)(x, deterministic=not train)
      return nn.with_logical_constraint(x, ('act_batch', 'act_len', 'act_embed'))

    enc_BMD = transformer.blocks(embed(inputs_BM, 'encoder_pos'), None, prefix='encoder_block',
                                 **common)
    enc_BMD = transformer.layer_norm('encoder_ln', self.dtype)(enc_BMD)
    x_BLD = transformer.blocks(embed(decoder_inputs_BL, 'decoder_pos'), enc_BMD,
                               prefix='decoder_block', causal=True, cross=True, **common)
    x_BLD = transformer.layer_norm('decoder_ln', self.dtype)(x_BLD)
    return vocab_logits(self, x_BLD, self.vocab_size, self.dtype)
