"""A multilayer perceptron classifier, laid out Megatron-style.

Hidden layers alternate column- and row-parallel kernels, as in the 4x2 example of
JAX's "Distributed arrays and automatic parallelization" tutorial and in Megatron-LM
(Shoeybi et al., 2019, arXiv:1909.08053): the first kernel is split over 'model' on
its output axis ('embed', 'mlp'), the next on its input axis ('mlp', 'embed'), so a
pair of layers needs one all-reduce.
"""
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from zoo.models.family import ModelFamily
from zoo.models.layers import dense, other_axis


class MLP(nn.Module):
  """ReLU MLP: inputs of any shape are flattened to features, then classified."""
  hidden_sizes: Sequence[int]
  num_classes: int

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
    del train  # No dropout or batch statistics.
    x_BF = x.reshape(x.shape[0], -1).astype(jnp.float32)
    x_BF = nn.with_logical_constraint(x_BF, ('act_batch', 'act_embed'))
    axis = 'embed'
    for i, size in enumerate(self.hidden_sizes):
      out = other_axis(axis)
      x_BF = nn.relu(dense(size, (axis, out), f'hidden_{i}')(x_BF))
      x_BF = nn.with_logical_constraint(x_BF, ('act_batch', f'act_{out}'))
      axis = out
    logits_BC = dense(self.num_classes, (axis, 'classes'), 'head')(x_BF)
    return nn.with_logical_constraint(logits_BC, ('act_batch', 'act_classes'))


FAMILY = ModelFamily(MLP, task='classification')
