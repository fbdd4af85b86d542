"""LoRA (Hu et al., arXiv:2106.09685): low-rank adapters beside a Transformer's projections.

A projection y = x W that `targets` names gains y += (alpha / rank) * dropout(x) A B, with
A [in, rank] drawn as PEFT draws it (uniform in +-1/sqrt(in)) and B [rank, out] zero, so an
adapted model starts as the base model. The adapters are parameters named
`<projection>_lora_a` and `_lora_b` beside the projection's kernel; their rank axis has the
logical name 'lora' (replicated), the other axes the projection's own, so they are sharded
by the same rules. Training with `rank` > 0 updates only the adapters (zoo.run.steps: no
gradient, no optimizer state and no all-reduce for the frozen base weights).

`config.model.lora` holds the fields of `Lora`; targets are zoo's projection names:
query, key, value, out (attention) and wi_gate, wi_up, wo, wi (MLP), i.e. Hugging Face's
q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (zoo.hf.adapters).
"""
import dataclasses
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from zoo.models import quantize
from zoo.models.layers import partitioned

PROJECTIONS = ('query', 'key', 'value', 'out', 'wi_gate', 'wi_up', 'wo', 'wi')
MARK = '_lora_'  # In the name of every adapter parameter, and of nothing else.


@dataclasses.dataclass(frozen=True)
class Lora:
  """An adapter configuration; rank 0: none."""
  rank: int = 0
  alpha: float = 0.0              # The scale is alpha / rank; 0: alpha = rank (scale 1).
  dropout: float = 0.0            # On the adapter's input, in training.
  targets: tuple = ('query', 'key', 'value', 'out', 'wi_gate', 'wi_up', 'wo')

  @property
  def scale(self) -> float:
    return (self.alpha or self.rank) / self.rank

  def adapts(self, name: str) -> bool:
    return bool(self.rank) and name in self.targets


def of(value: Any) -> Lora:
  """A Lora from config.model.lora (a ConfigDict or dict), or an existing Lora."""
  if isinstance(value, Lora):
    return value
  fields = dict(value.items()) if hasattr(value, 'items') else {}
  if 'targets' in fields:
    fields['targets'] = tuple(fields['targets'])
  return Lora(**fields)


def is_adapter(path: Sequence[str]) -> bool:
  """Whether a parameter (its path of names) is an adapter's."""
  return MARK in str(path[-1])


def _a_init(fan_in: int) -> nn.initializers.Initializer:
  bound = fan_in ** -0.5
  return lambda key, shape, dtype=jnp.float32: jax.random.uniform(key, shape, dtype, -bound, bound)


def einsum(module: nn.Module, spec: Lora, name: str, ins: str, outs: str, x: jax.Array,
           w: jax.Array, axes: Sequence, dtype: Any, deterministic: bool) -> jax.Array:
  """x [B, L, *ins] times the kernel w [*ins, *outs] (logical `axes`), in low precision
  where the module's quantization applies to it (zoo.models.quantize), plus the adapter of
  `name` if `spec` adapts it (never quantized)."""
  y = quantize.einsum(getattr(module, 'quantization', quantize.Quantization()),
                      '/'.join((*module.path, name)), ins, outs, x, w)
  if not spec.adapts(name):
    return y
  in_shape, out_shape = w.shape[:len(ins)], w.shape[len(ins):]
  fan_in = 1
  for n in in_shape:
    fan_in *= n
  a = module.param(f'{name}{MARK}a', partitioned(_a_init(fan_in), (*axes[:len(ins)], 'lora')),
                   (*in_shape, spec.rank)).astype(dtype)
  b = module.param(f'{name}{MARK}b', partitioned(nn.initializers.zeros_init(),
                                                 ('lora', *axes[len(ins):])),
                   (spec.rank, *out_shape)).astype(dtype)
  if spec.dropout:
    x = nn.Dropout(spec.dropout, name=f'{name}{MARK}dropout')(x, deterministic=deterministic)
  low = jnp.einsum(f'BL{ins},{ins}R->BLR', x, a)
  return y + spec.scale * jnp.einsum(f'BLR,R{outs}->BL{outs}', low, b)
