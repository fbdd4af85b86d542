"""A LeNet-style convolutional classifier (LeCun et al., 1998), for small images.

Convolutions alternate their channel axes like the MLP's Megatron layout: the first
conv's output channels are split over 'model' ('embed' -> 'mlp'), the next one's input
channels ('mlp' -> 'embed'), so a pair of convolutions needs one all-reduce. Each conv
is followed by ReLU and 2x2 average pooling; a hidden Dense layer and the head follow.
"""
from typing import Sequence

import flax.linen as nn
import jax.numpy as jnp

TASK = 'classification'


def _partitioned(init, axes):
  return nn.with_logical_partitioning(init, axes)


class CNN(nn.Module):
  """Images [B, H, W] or [B, H, W, C] -> class logits [B, num_classes]."""
  features: Sequence[int]
  hidden: int
  num_classes: int

  @nn.compact
  def __call__(self, x, train=False):
    del train  # No dropout or batch statistics.
    x_BHWC = x.astype(jnp.float32)
    if x_BHWC.ndim == 3:
      x_BHWC = x_BHWC[..., None]
    act = lambda channels: ('act_batch', 'act_height', 'act_width', channels)
    x_BHWC = nn.with_logical_constraint(x_BHWC, act('act_embed'))
    axis = 'embed'
    for i, features in enumerate(self.features):
      out = 'mlp' if axis == 'embed' else 'embed'
      x_BHWC = nn.Conv(
          features, (3, 3), padding='SAME', name=f'conv_{i}',
          kernel_init=_partitioned(nn.initializers.lecun_normal(), ('conv_height', 'conv_width', axis, out)),
          bias_init=_partitioned(nn.initializers.zeros_init(), (out,)))(x_BHWC)
      x_BHWC = nn.avg_pool(nn.relu(x_BHWC), (2, 2), strides=(2, 2), padding='SAME')
      x_BHWC = nn.with_logical_constraint(x_BHWC, act(f'act_{out}'))
      axis = out
    x_BF = x_BHWC.reshape(x_BHWC.shape[0], -1)  # F = H * W * C, channels fastest.
    out = 'mlp' if axis == 'embed' else 'embed'
    x_BF = nn.relu(nn.Dense(
        self.hidden, name='hidden',
        kernel_init=_partitioned(nn.initializers.lecun_normal(), (axis, out)),
        bias_init=_partitioned(nn.initializers.zeros_init(), (out,)))(x_BF))
    x_BF = nn.with_logical_constraint(x_BF, ('act_batch', f'act_{out}'))
    logits_BC = nn.Dense(
        self.num_classes, name='head',
        kernel_init=_partitioned(nn.initializers.lecun_normal(), (out, 'classes')),
        bias_init=_partitioned(nn.initializers.zeros_init(), ('classes',)))(x_BF)
    return nn.with_logical_constraint(logits_BC, ('act_batch', 'act_classes'))
