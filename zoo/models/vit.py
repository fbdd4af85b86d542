"""A Vision Transformer (Dosovitskiy et al., 2020, arXiv:2010.11929), for small images.

Non-overlapping patches are embedded by one strided convolution, a class token is
prepended (or the patches are mean-pooled, `pool='mean'`), learned positions are added
and pre-norm Transformer blocks follow; the head reads the class token. The blocks take
zoo.models.transformer's switches: scan_layers, remat, dtype, dropout_rate.
"""
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from zoo.errors import fail
from zoo.models import layers, transformer
from zoo.models.family import ModelFamily

POOLS = ('cls', 'mean')


class ViT(transformer.Transformer, kw_only=True):
  """Images [B, H, W] or [B, H, W, C] -> class logits [B, num_classes]."""
  patch_size: int
  num_classes: int
  pool: str = 'cls'              # 'cls' (class token) or 'mean' (average of the patches).

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
    x_BHWC = layers.images(x)
    p = self.patch_size
    x_BHWD = nn.Conv(
        self.d_model, (p, p), strides=(p, p), padding='VALID', name='patch_embed', dtype=self.dtype,
        kernel_init=layers.partitioned(nn.initializers.lecun_normal(),
                                       ('conv_height', 'conv_width', None, 'embed')),
        bias_init=layers.partitioned(nn.initializers.zeros_init(), ('embed',)))(x_BHWC)
    x_BLD = x_BHWD.reshape(x_BHWD.shape[0], -1, self.d_model)  # L = patches, row-major.
    if self.pool == 'cls':
      zeros = layers.partitioned(nn.initializers.zeros_init(), (None, None, 'embed'))
      cls_11D = self.param('cls', zeros, (1, 1, self.d_model)).astype(x_BLD.dtype)
      cls_B1D = jnp.broadcast_to(cls_11D, (x_BLD.shape[0], 1, self.d_model))
      x_BLD = jnp.concatenate([cls_B1D, x_BLD], 1)
    x_BLD = transformer.embed_positions(self, x_BLD, 'learned', x_BLD.shape[1], 'pos_embed', train)
    x_BLD = transformer.blocks(self, x_BLD, prefix='block', train=train)
    x_BLD = transformer.norm(self, 'ln_final')(x_BLD)
    x_BD = x_BLD[:, 0] if self.pool == 'cls' else x_BLD.mean(axis=1)
    logits_BC = layers.dense(self.num_classes, ('embed', 'classes'), 'head', dtype=jnp.float32,
                             kernel_init=nn.initializers.zeros_init())(x_BD.astype(jnp.float32))
    return nn.with_logical_constraint(logits_BC, ('act_batch', 'act_classes'))


def check_config(m: ml_collections.ConfigDict) -> None:
  if m.get('pool', 'cls') not in POOLS:
    fail('model.pool', f'unknown pool {m.pool!r}; known: {", ".join(POOLS)}')
  transformer.check_config(m)


def check_inputs(m: ml_collections.ConfigDict, inputs: Sequence[np.ndarray]) -> None:
  image = inputs[0].shape[1:3]
  if any(size % m.patch_size for size in image):
    fail('model.patch_size', f'{m.patch_size} does not divide the {image[0]}x{image[1]} images; '
         'pick a divisor of both sides')


FAMILY = ModelFamily(ViT, task='classification', check_config=check_config,
                     check_inputs=check_inputs)
