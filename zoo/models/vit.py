"""A Vision Transformer (Dosovitskiy et al., 2020, arXiv:2010.11929), for small images.

Non-overlapping patches are embedded by one strided convolution, a class token is
prepended (or the patches are mean-pooled, `pool='mean'`), learned positions are added
and pre-norm Transformer blocks follow; the head reads the class token. The blocks take
zoo.models.transformer's switches: scan_layers, remat, dtype, dropout_rate.
"""
import flax.linen as nn
import jax.numpy as jnp

from zoo.models import transformer

TASK = 'classification'


def _partitioned(init, axes):
  return nn.with_logical_partitioning(init, axes)


class ViT(nn.Module):
  """Images [B, H, W] or [B, H, W, C] -> class logits [B, num_classes]."""
  patch_size: int
  num_layers: int
  d_model: int
  num_heads: int
  mlp_dim: int
  num_classes: int
  pool: str = 'cls'              # 'cls' (class token) or 'mean' (average of the patches).
  scan_layers: bool = False
  remat: str = 'none'
  dtype: str = 'float32'
  dropout_rate: float = 0.0

  @nn.compact
  def __call__(self, x, train=False):
    x_BHWC = x.astype(jnp.float32)
    if x_BHWC.ndim == 3:
      x_BHWC = x_BHWC[..., None]
    p = self.patch_size
    x_BHWD = nn.Conv(
        self.d_model, (p, p), strides=(p, p), padding='VALID', name='patch_embed', dtype=self.dtype,
        kernel_init=_partitioned(nn.initializers.lecun_normal(),
                                 ('conv_height', 'conv_width', None, 'embed')),
        bias_init=_partitioned(nn.initializers.zeros_init(), ('embed',)))(x_BHWC)
    x_BLD = x_BHWD.reshape(x_BHWD.shape[0], -1, self.d_model)  # L = patches, row-major.
    if self.pool == 'cls':
      cls_11D = self.param('cls', _partitioned(nn.initializers.zeros_init(), (None, None, 'embed')),
                           (1, 1, self.d_model)).astype(x_BLD.dtype)
      x_BLD = jnp.concatenate([jnp.broadcast_to(cls_11D, (x_BLD.shape[0], 1, self.d_model)), x_BLD], 1)
    x_BLD = transformer.embed_positions(self, x_BLD, 'learned', x_BLD.shape[1], 'pos_embed', self.dtype)
    x_BLD = nn.Dropout(self.dropout_rate)(x_BLD, deterministic=not train)
    x_BLD = nn.with_logical_constraint(x_BLD, ('act_batch', 'act_len', 'act_embed'))
    x_BLD = transformer.blocks(
        x_BLD, None, num_layers=self.num_layers, scan_layers=self.scan_layers, remat=self.remat,
        prefix='block', num_heads=self.num_heads, mlp_dim=self.mlp_dim, dtype=self.dtype,
        dropout_rate=self.dropout_rate, deterministic=not train)
    x_BLD = transformer.layer_norm('ln_final', self.dtype)(x_BLD)
    x_BD = x_BLD[:, 0] if self.pool == 'cls' else x_BLD.mean(axis=1)
    logits_BC = nn.Dense(
        self.num_classes, name='head', dtype=jnp.float32,
        kernel_init=_partitioned(nn.initializers.zeros_init(), ('embed', 'classes')),
        bias_init=_partitioned(nn.initializers.zeros_init(), ('classes',)))(x_BD.astype(jnp.float32))
    return nn.with_logical_constraint(logits_BC, ('act_batch', 'act_classes'))
