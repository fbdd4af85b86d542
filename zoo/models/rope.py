"""Rotary position embedding (RoFormer, Su et al., arXiv:2104.09864) and its frequency
scalings: 'linear' (position interpolation, Chen et al., arXiv:2306.15595), 'llama3'
(Llama 3.1's: long wavelengths divided by `factor`, short ones kept, a smooth ramp between;
Meta's reference code and Hugging Face's `_compute_llama3_parameters`) and 'yarn' (Peng et
al., arXiv:2309.00071, as Qwen and DeepSeek configs use it: frequencies that turn fewer than
`beta_slow` times over the original context divided by `factor`, those that turn more than
`beta_fast` times kept, a linear ramp over the feature pairs between, and the rotated
queries and keys scaled by `attention_factor`, by default 0.1 ln(factor) + 1; Hugging
Face's `_compute_yarn_parameters`).

Frequencies are computed in float32 with jax.numpy, inside the traced model: under
`jax.eval_shape` (the preflight, before a size is checked) they are shapes, not arrays, so
a huge head_dim is refused by the memory bound instead of filling the host. A layer's
rotation is then `rotate(x, positions, frequencies)`. Pairs of features (i, i + H/2) turn
together, Hugging Face's `rotate_half` layout.
"""
import dataclasses
import math
from typing import Union

import jax
import jax.numpy as jnp

SCALINGS = ('none', 'linear', 'llama3', 'yarn')


@dataclasses.dataclass(frozen=True)
class Rope:
  """A rotary embedding's base and scaling (the Transformer's rope_* fields)."""
  theta: float = 10000.0
  scaling: str = 'none'
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_len: int = 0       # llama3, yarn: the context the base model was trained on.
  beta_fast: float = 32.0         # yarn: rotations over the original context above which a
  beta_slow: float = 1.0          # frequency is kept, below which it is divided by factor.
  attention_factor: float = 0.0   # yarn: rotated queries' and keys' scale; 0: 0.1 ln(factor) + 1.

  def scale(self) -> float:
    """What the rotated queries and keys are multiplied by (yarn's attention factor; 1)."""
    if self.scaling != 'yarn':
      return 1.0
    if self.attention_factor:
      return float(self.attention_factor)
    return 1.0 if self.factor <= 1 else 0.1 * math.log(self.factor) + 1.0

  def frequencies(self, head_size: int) -> jax.Array:
    """float32 [head_size / 2]: the angle per position of each pair of features."""
    f32 = jnp.float32
    exponents = jnp.arange(0, head_size, 2, dtype=f32) / f32(head_size)
    inv = f32(1.0) / (f32(self.theta) ** exponents)
    if self.scaling == 'linear':
      return inv / f32(self.factor)
    if self.scaling == 'llama3':
      factor, low, high = (f32(v) for v in (self.factor, self.low_freq_factor,
                                            self.high_freq_factor))
      original = f32(self.original_max_len)
      wavelength = f32(2 * math.pi) / inv
      scaled = jnp.where(wavelength > original / low, inv / factor, inv)
      smooth = (original / wavelength - low) / (high - low)
      ramp = (1 - smooth) * scaled / factor + smooth * scaled
      medium = ~(wavelength < original / high) & ~(wavelength > original / low)
      return jnp.where(medium, ramp, scaled)
    if self.scaling == 'yarn':
      # The feature pair at which a frequency turns `rotations` times over the original
      # context, rounded outwards and clipped to the pairs there are.
      pair = lambda rotations: (head_size * math.log(self.original_max_len / (
          rotations * 2 * math.pi)) / (2 * math.log(self.theta)))
      low = max(math.floor(pair(self.beta_fast)), 0)
      high = min(math.ceil(pair(self.beta_slow)), head_size - 1)
      high = high + 0.001 if low == high else high
      ramp = jnp.clip((jnp.arange(head_size // 2, dtype=f32) - f32(low)) / f32(high - low), 0, 1)
      return inv / f32(self.factor) * ramp + inv * (1 - ramp)
    return inv


def rotate(x_BLNH: jax.Array, positions_BL: jax.Array, frequencies_H: jax.Array,
           scale: Union[float, jax.Array] = 1.0) -> jax.Array:
  """x turned by the angles positions x frequencies (H/2 of them) and times `scale`
  (Rope.scale), in float32."""
  angle_BLH = positions_BL.astype(jnp.float32)[..., None] * jnp.asarray(frequencies_H, jnp.float32)
  cos, sin = jnp.cos(angle_BLH)[:, :, None], jnp.sin(angle_BLH)[:, :, None]  # [B, L, 1, H/2]
  if not isinstance(scale, float) or scale != 1.0:
    cos, sin = cos * scale, sin * scale
  x1, x2 = jnp.split(x_BLNH.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x_BLNH.dtype)
