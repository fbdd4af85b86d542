"""LoRA adapters out of a zoo run: merged into the weights they adapt (a full Hugging Face
checkpoint), or alone as a PEFT adapter directory that `peft.PeftModel.from_pretrained`
loads onto the base model.

PEFT's format (peft 0.21): adapter_config.json (peft_type LORA, r, lora_alpha,
lora_dropout, target_modules, ...) and adapter_model.safetensors with, per adapted module,
`base_model.model.<module>.lora_A.weight` [r, in] and `lora_B.weight` [out, r]; a layer
computes base(x) + lora_B(lora_A(x)) * lora_alpha / r. zoo's adapter of a projection with
kernel [*in, *out] is A [*in, r], B [r, *out] (zoo.models.lora): A flattened and
transposed is lora_A, B flattened and transposed lora_B, in the order Hugging Face's
head-major rows use (zoo.hf.layouts).
"""
import json
import os
import re
from typing import Callable, Optional

import numpy as np

from zoo.errors import ConfigError
from zoo.models import lora

# zoo's projection -> the module of a decoder in Llama's layout (Llama, Mistral, Qwen, Gemma).
MODULES = {'query': 'self_attn.q_proj', 'key': 'self_attn.k_proj', 'value': 'self_attn.v_proj',
           'out': 'self_attn.o_proj', 'wi_gate': 'mlp.gate_proj', 'wi_up': 'mlp.up_proj',
           'wo': 'mlp.down_proj'}
LAYOUTS = ('llama', 'mistral', 'qwen2', 'qwen3', 'gemma', 'gemma2', 'gemma3_text', 'mixtral',
           'qwen2_moe', 'qwen3_moe')  # Routed experts: adapters on attention only.
_ADAPTER = re.compile(r'^block_(\d+)/(attn|mlp)/(\w+)' + lora.MARK + r'([ab])$')


def check(model_type: str, spec: lora.Lora) -> None:
  """ConfigError unless the run has adapters that a PEFT directory can hold."""
  if not spec.rank:
    raise ConfigError('--peft: the run has no LoRA adapters (model.lora.rank is 0); export '
                      'its whole weights without --peft')
  if model_type not in LAYOUTS:
    raise ConfigError(f'--peft: PEFT adapters are written for decoders in Llama\'s layout '
                      f'({", ".join(LAYOUTS)}), not {model_type}; export merged weights '
                      'without --peft')
  unknown = sorted(set(spec.targets) - set(MODULES))
  if unknown:
    raise ConfigError(f'--peft: model.lora.targets {unknown} have no module in that layout')


def _adapters(params: dict) -> dict:
  """{(layer, projection): {'a': A, 'b': B, 'kernel': path of the adapted kernel}}."""
  found = {}
  for path in params:
    match = _ADAPTER.match(path)
    if match:
      layer, part, name, which = match.groups()
      entry = found.setdefault((int(layer), name), {'kernel': f'block_{layer}/{part}/{name}'})
      entry[which] = path
  return found


def merge(params: dict, spec: lora.Lora) -> None:
  """Adds each adapter's scale x A B to the kernel it adapts (float32) and drops the
  adapters from `params` (paths -> arrays), in place."""
  for entry in _adapters(params).values():
    a, b = np.asarray(params.pop(entry['a']), np.float32), np.asarray(params.pop(entry['b']),
                                                                       np.float32)
    kernel = np.asarray(params[entry['kernel']], np.float32)
    params[entry['kernel']] = kernel + np.float32(spec.scale) * np.tensordot(a, b, axes=1)


def write(hf_dir: str, params: dict, spec: lora.Lora, num_layers: int, base: Optional[str],
          save_file: Callable) -> None:
  """A PEFT adapter directory of the run's adapters (`base`: the Hugging Face directory the
  run was imported from, recorded as base_model_name_or_path)."""
  tensors = {}
  for (layer, name), entry in sorted(_adapters(params).items()):
    a, b = np.asarray(params[entry['a']], np.float32), np.asarray(params[entry['b']], np.float32)
    rank = a.shape[-1]
    module = f'base_model.model.model.layers.{layer}.{MODULES[name]}'
    tensors[f'{module}.lora_A.weight'] = np.ascontiguousarray(a.reshape(-1, rank).T)
    tensors[f'{module}.lora_B.weight'] = np.ascontiguousarray(b.reshape(rank, -1).T)
  if len(tensors) != 2 * num_layers * len(spec.targets):
    raise ConfigError(f'--workdir: the checkpoint holds {len(tensors) // 2} adapters, but '
                      f'model.lora names {len(spec.targets)} in each of {num_layers} layers')
  save_file(tensors, os.path.join(hf_dir, 'adapter_model.safetensors'),
            metadata={'format': 'pt'})
  config = {'peft_type': 'LORA', 'task_type': 'CAUSAL_LM', 'r': spec.rank,
            'lora_alpha': spec.alpha or spec.rank, 'lora_dropout': spec.dropout,
            'target_modules': sorted(MODULES[t].split('.')[-1] for t in spec.targets),
            'bias': 'none', 'fan_in_fan_out': False, 'use_rslora': False, 'use_dora': False,
            'inference_mode': True, 'base_model_name_or_path': base}
  with open(os.path.join(hf_dir, 'adapter_config.json'), 'w', encoding='utf-8') as f:
    json.dump(config, f, indent=2)
