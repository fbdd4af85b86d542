"""An encoder-decoder Transformer (Vaswani et al., 2017, arXiv:1706.03762), pre-norm.

The encoder reads the source with bidirectional self-attention; the decoder reads the
target shifted right (teacher forcing) with causal self-attention and cross-attention to
the encoder's output. Source and target share one embedding table. The layers and their
switches are zoo.models.transformer's; `num_layers` blocks on each side.
"""
import flax.linen as nn
import jax

from zoo.models import layers, transformer
from zoo.models.family import ModelFamily


class EncoderDecoder(transformer.Transformer, kw_only=True):
  """(source ids [B, M], shifted target ids [B, L]) -> logits [B, L, padded vocab], float32."""
  vocab_size: int
  max_len: int
  positions: str = 'learned'

  @nn.compact
  def __call__(self, inputs_BM: jax.Array, decoder_inputs_BL: jax.Array,
               train: bool = False) -> jax.Array:
    embed_VD = layers.embedding_table(self, self.vocab_size, self.d_model, self.dtype)
    rotary = self.positions == 'rotary'

    def embed(tokens, pos_name):
      x_BLD = transformer.embed_tokens(self, embed_VD, tokens)
      return transformer.embed_positions(self, x_BLD, self.positions, self.max_len, pos_name, train)

    enc_BMD = transformer.blocks(self, embed(inputs_BM, 'encoder_pos'), prefix='encoder_block',
                                 train=train, rotary=rotary)
    enc_BMD = transformer.norm(self, 'encoder_ln')(enc_BMD)
    x_BLD = transformer.blocks(self, embed(decoder_inputs_BL, 'decoder_pos'), enc_BMD,
                               prefix='decoder_block', train=train, causal=True, cross=True,
                               rotary=rotary)
    x_BLD = transformer.norm(self, 'decoder_ln')(x_BLD)
    return layers.vocab_logits(self, x_BLD, self.vocab_size, self.dtype)


FAMILY = ModelFamily(EncoderDecoder, task='seq2seq', check_config=transformer.check_config,
                     check_inputs=transformer.check_lengths)
