"""A ResNet with BatchNorm (He et al., 2016, arXiv:1512.03385), sized for small images.

Basic blocks (two 3x3 convolutions) in stages; a stage after the first halves the
resolution. Each block is laid out like a Megatron MLP: its first conv splits its output
channels over 'model' ('embed' -> 'mlp'), its second conv its input channels
('mlp' -> 'embed'), so the residual stream stays whole and a block needs one all-reduce.

BatchNorm's running statistics live in the 'batch_stats' collection, which zoo keeps in
the train state and checkpoints. They carry logical axis names, so they are sharded like
the channels they describe.
"""
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from zoo.errors import fail
from zoo.models import layers
from zoo.models.family import ModelFamily


class BatchNorm(nn.Module):
  """Batch normalisation over every axis but the last (channels, named `channel_axis`).

  Statistics are global over the batch on any mesh: under jit the mean of an array whose
  batch axis is sharded is a cross-device reduction (the pmap idiom's `axis_name` and
  pmean are not needed). Flax's nn.BatchNorm cannot name its statistics' axes, hence ours.
  """
  channel_axis: str
  momentum: float = 0.9
  epsilon: float = 1e-5
  scale_init: nn.initializers.Initializer = nn.initializers.ones_init()

  @nn.compact
  def __call__(self, x, train):
    shape, axes = (x.shape[-1],), (self.channel_axis,)
    zeros, ones = nn.initializers.zeros_init(), nn.initializers.ones_init()
    stat = lambda name, init: self.variable('batch_stats', name, layers.partitioned(init, axes),
                                            None, shape, jnp.float32)
    mean, var = stat('mean', zeros), stat('var', ones)
    scale = self.param('scale', layers.partitioned(self.scale_init, axes), shape)
    bias = self.param('bias', layers.partitioned(zeros, axes), shape)
    x = x.astype(jnp.float32)
    if train:
      reduce = tuple(range(x.ndim - 1))
      batch_mean = x.mean(reduce)
      batch_var = jnp.maximum((x * x).mean(reduce) - batch_mean * batch_mean, 0.0)
      if not self.is_initializing():
        mean.value = self.momentum * mean.value + (1 - self.momentum) * batch_mean
        var.value = self.momentum * var.value + (1 - self.momentum) * batch_var
    else:
      batch_mean, batch_var = mean.value, var.value
    return (x - batch_mean) * (scale * (1.0 / jnp.sqrt(batch_var + self.epsilon))) + bias


def _conv(features, kernel, strides, axes, name):
  return nn.Conv(features, (kernel, kernel), strides, padding='SAME', use_bias=False, name=name,
                 kernel_init=layers.partitioned(nn.initializers.he_normal(),
                                          ('conv_height', 'conv_width') + axes))


def _constrain(x, channels):
  return nn.with_logical_constraint(x, ('act_batch', 'act_height', 'act_width', channels))


class BasicBlock(nn.Module):
  """conv-BN-ReLU-conv-BN plus the shortcut (a 1x1 conv + BN where the shape changes)."""
  features: int
  strides: int

  @nn.compact
  def __call__(self, x_BHWC, train):
    y = _conv(self.features, 3, self.strides, ('embed', 'mlp'), 'conv_0')(x_BHWC)
    y = _constrain(nn.relu(BatchNorm('mlp', name='bn_0')(y, train)), 'act_mlp')
    y = _conv(self.features, 3, 1, ('mlp', 'embed'), 'conv_1')(y)
    # Zero-initialised last scale: each block starts as the identity (Goyal et al., 2017).
    y = BatchNorm('embed', scale_init=nn.initializers.zeros_init(), name='bn_1')(y, train)
    if x_BHWC.shape != y.shape:
      x_BHWC = _conv(self.features, 1, self.strides, (None, 'embed'), 'shortcut')(x_BHWC)
      x_BHWC = BatchNorm('embed', name='bn_shortcut')(x_BHWC, train)
    return _constrain(nn.relu(x_BHWC + y), 'act_embed')


class ResNet(nn.Module):
  """Images [B, H, W] or [B, H, W, C] -> class logits [B, num_classes]."""
  stage_sizes: Sequence[int]     # Blocks per stage.
  features: Sequence[int]        # Channels per stage.
  num_classes: int

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
    x_BHWC = _constrain(layers.images(x), 'act_embed')
    # The stem's input channels are few (1 for the digits): replicated.
    x_BHWC = _conv(self.features[0], 3, 1, (None, 'embed'), 'stem')(x_BHWC)
    x_BHWC = _constrain(nn.relu(BatchNorm('embed', name='bn_stem')(x_BHWC, train)), 'act_embed')
    for i, (blocks, features) in enumerate(zip(self.stage_sizes, self.features)):
      for j in range(blocks):
        strides = 2 if i > 0 and j == 0 else 1
        x_BHWC = BasicBlock(features, strides, name=f'stage_{i}_block_{j}')(x_BHWC, train)
    x_BC = x_BHWC.mean(axis=(1, 2))
    logits_BC = layers.dense(self.num_classes, ('embed', 'classes'), 'head')(x_BC)
    return nn.with_logical_constraint(logits_BC, ('act_batch', 'act_classes'))


def check_config(m: ml_collections.ConfigDict) -> None:
  if len(m.stage_sizes) != len(m.features):
    fail('model.features', f'{tuple(m.features)} must give one channel count per stage of '
         f'model.stage_sizes={tuple(m.stage_sizes)}')


FAMILY = ModelFamily(ResNet, task='classification', check_config=check_config)
