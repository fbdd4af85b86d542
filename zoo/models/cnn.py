"""A LeNet-style convolutional classifier (LeCun et al., 1998), for small images.

Convolutions alternate their channel axes like the MLP's Megatron layout: the first
conv's output channels are split over 'model' ('embed' -> 'mlp'), the next one's input
channels ('mlp' -> 'embed'), so a pair of convolutions needs one all-reduce. Each conv
is followed by ReLU and 2x2 average pooling; a hidden Dense layer and the head follow.
"""
from typing import Sequence

import flax.linen as nn
import jax

from zoo.models import layers
from zoo.models.family import ModelFamily


class CNN(nn.Module):
  """Images [B, H, W] or [B, H, W, C] -> class logits [B, num_classes]."""
  features: Sequence[int]
  hidden: int
  num_classes: int

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
    del train  # No dropout or batch statistics.
    act = lambda channels: ('act_batch', 'act_height', 'act_width', channels)
    x_BHWC = nn.with_logical_constraint(layers.images(x), act('act_embed'))
    axis = 'embed'
    for i, features in enumerate(self.features):
      out = layers.other_axis(axis)
      x_BHWC = nn.Conv(
          features, (3, 3), padding='SAME', name=f'conv_{i}',
          kernel_init=layers.partitioned(nn.initializers.lecun_normal(),
                                         ('conv_height', 'conv_width', axis, out)),
          bias_init=layers.partitioned(nn.initializers.zeros_init(), (out,)))(x_BHWC)
      x_BHWC = nn.avg_pool(nn.relu(x_BHWC), (2, 2), strides=(2, 2), padding='SAME')
      x_BHWC = nn.with_logical_constraint(x_BHWC, act(f'act_{out}'))
      axis = out
    x_BF = x_BHWC.reshape(x_BHWC.shape[0], -1)  # F = H * W * C, channels fastest.
    out = layers.other_axis(axis)
    x_BF = nn.relu(layers.dense(self.hidden, (axis, out), 'hidden')(x_BF))
    x_BF = nn.with_logical_constraint(x_BF, ('act_batch', f'act_{out}'))
    logits_BC = layers.dense(self.num_classes, (out, 'classes'), 'head')(x_BF)
    return nn.with_logical_constraint(logits_BC, ('act_batch', 'act_classes'))


FAMILY = ModelFamily(CNN, task='classification')
