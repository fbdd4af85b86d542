"""Hugging Face layouts zoo imports and exports: GPT-2, Llama and ViT as settings of zoo's
Transformer families, and each HF tensor's place among zoo's parameters.

An `Architecture` maps a HF `config.json` to `config.model` fields and back, and lists the
HF tensors with, for each, the zoo parameter paths it becomes and the two transforms
between them. The import transforms return numpy *views* where they can (transposes,
reshapes, column splits), so that zoo.convert copies only each device's shard.

Layouts (HF torch -> zoo): nn.Linear weights are [out, in] (zoo: [in, ...]); GPT-2's
Conv1D weights are already [in, out], its c_attn holds q, k and v side by side; attention
kernels become [D, heads, head size] and the output [heads, head size, D]; embeddings are
padded to zoo's vocabulary multiple of 128 (zero rows, never predicted), which export
drops; ViT's patch convolution [D, C, p, p] becomes Flax's [p, p, C, D].
"""
import dataclasses
import math
from typing import Callable, Optional

import numpy as np

from zoo.errors import ConfigError
from zoo.models import layers


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One HF tensor: its name, shape, the zoo parameters ('/'-joined paths) it becomes, and
  the transforms hf -> tuple of zoo arrays, and zoo arrays -> hf."""
  name: str
  shape: tuple
  zoo: tuple
  to_zoo: Callable[[np.ndarray], tuple]
  to_hf: Callable[..., np.ndarray]
  expert: Optional[int] = None  # This tensor is that row of its zoo parameter [E, ...].


def _same(name, shape, path):
  return Tensor(name, shape, (path,), lambda x: (x,), lambda x: x)


def _transposed(name, shape, path):  # nn.Linear [out, in] <-> [in, out].
  return Tensor(name, shape, (path,), lambda x: (x.T,), lambda x: x.T)


def _vocab(name, vocab, d, path, transposed=False):
  """An embedding [V, D] (or a head [V, D] stored as zoo's [D, V]) padded to 128s of rows."""
  padded = layers.padded_vocab_size(vocab)
  if transposed:
    return Tensor(name, (vocab, d), (path,), lambda x: (_PaddedRows(x, padded).T,),
                  lambda x: x[:, :vocab].T)
  return Tensor(name, (vocab, d), (path,), lambda x: (_PaddedRows(x, padded),), lambda x: x[:vocab])


class _PaddedRows:
  """x [V, D] as if zero rows padded it to `rows`: indexing reads only the shard asked for."""

  def __init__(self, x: np.ndarray, rows: int, transposed: bool = False):
    self.x, self.rows, self.transposed = x, rows, transposed
    self.shape = (x.shape[1], rows) if transposed else (rows, x.shape[1])
    self.dtype = x.dtype

  @property
  def T(self) -> '_PaddedRows':  # pylint: disable=invalid-name
    return _PaddedRows(self.x, self.rows, not self.transposed)

  def __getitem__(self, index: tuple) -> np.ndarray:
    rows_index, cols = (index[1], index[0]) if self.transposed else index
    start, stop, _ = rows_index.indices(self.rows)
    part = np.zeros((stop - start, self.x.shape[1]), self.x.dtype)
    have = max(0, min(stop, self.x.shape[0]) - start)
    part[:have] = self.x[start:start + have]
    part = part[:, cols]
    return part.T if self.transposed else part


def _heads_in(name, shape, path, heads, head):  # Linear [heads*head, D] -> [D, heads, head].
  d = shape[1]
  return Tensor(name, shape, (path,), lambda x: (x.reshape(heads, head, d).transpose(2, 0, 1),),
                lambda x: x.transpose(1, 2, 0).reshape(heads * head, d))


def _heads_out(name, shape, path, heads, head):  # Linear [D, heads*head] -> [heads, head, D].
  d = shape[0]
  return Tensor(name, shape, (path,), lambda x: (x.T.reshape(heads, head, d),),
                lambda x: x.reshape(heads * head, d).T)


def _bias_heads(name, heads, head, path):
  return Tensor(name, (heads * head,), (path,), lambda x: (x.reshape(heads, head),),
                lambda x: x.reshape(-1))


@dataclasses.dataclass(frozen=True)
class Kind:
  """What the models of a layout read: text (with a tokenizer) or images."""
  task: str                                 # A key of zoo.run.tasks.TASKS.
  size_field: str                           # The model field the data sizes.
  tokenizer: bool                           # A workdir of it keeps the tokenizer.json.
  data: Callable[[dict], dict]              # Model fields -> config.data (a shape only).
  example: Callable[[dict], dict]           # Model fields -> one example batch.


TEXT = Kind('lm', 'vocab_size', True,
            lambda f: {'name': 'tokens', 'path': '', 'seq_len': min(f['max_len'], 1024)},
            lambda f: {'inputs': np.zeros((1, 8), np.int32), 'targets': np.zeros((1, 8), np.int32)})
IMAGES = Kind('classification', 'num_classes', False, lambda f: {'name': 'records', 'path': ''},
              lambda f: {'inputs': np.zeros((1, f['image_size'], f['image_size'],
                                             f['num_channels']), np.float32),
                         'targets': np.zeros((1,), np.int32)})


@dataclasses.dataclass(frozen=True)
class Architecture:
  """A HF model type zoo speaks."""
  hf_class: str                  # transformers' class that loads an export.
  family: str                    # zoo's model.name.
  kind: Kind
  # HF config.json -> config.model fields (not name; the ViT adds image_size, num_channels).
  from_hf: Callable[[dict], dict]
  to_hf: Callable[[dict], dict]           # The same fields -> HF config.json.
  # config.model fields (for the ViT, plus image_size and num_channels) -> [Tensor].
  tensors: Callable[[dict], list]
  matches: Callable[[dict], bool]         # Whether config.model fields are this layout.
  ignored: tuple = ()                     # HF tensor name suffixes an import may skip.
  # (fields, params by path) -> fields an export reads off the params (the ViT's image).
  from_params: Callable[[dict, dict], dict] = lambda fields, params: fields


# GPT-2: learned positions, LayerNorm with bias, GELU (tanh), biases, tied embeddings.

def _gpt2_from_hf(c):
  unsupported = {k: c.get(k) for k in ('scale_attn_by_inverse_layer_idx', 'reorder_and_upcast_attn',
                                       'add_cross_attention') if c.get(k)}
  if c.get('activation_function', 'gelu_new') not in ('gelu_new', 'gelu_pytorch_tanh'):
    unsupported['activation_function'] = c.get('activation_function')
  if not c.get('scale_attn_weights', True):
    unsupported['scale_attn_weights'] = False
  if not c.get('tie_word_embeddings', True):
    unsupported['tie_word_embeddings'] = False
  _refuse(unsupported, 'gpt2')
  d = c['n_embd']
  return dict(vocab_size=c['vocab_size'], num_layers=c['n_layer'], d_model=d,
              num_heads=c['n_head'], mlp_dim=c.get('n_inner') or 4 * d, max_len=c['n_positions'],
              positions='learned', norm='layer', norm_epsilon=c.get('layer_norm_epsilon', 1e-5),
              mlp_activation='gelu', use_bias=True, tie_embeddings=True)


def _gpt2_to_hf(m):
  return dict(architectures=['GPT2LMHeadModel'], model_type='gpt2', vocab_size=m['vocab_size'],
              n_positions=m['max_len'], n_embd=m['d_model'], n_layer=m['num_layers'],
              n_head=m['num_heads'], n_inner=m['mlp_dim'], activation_function='gelu_new',
              layer_norm_epsilon=m['norm_epsilon'], tie_word_embeddings=True,
              scale_attn_weights=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def _gpt2_tensors(m):
  d, n, f = m['d_model'], m['num_heads'], m['mlp_dim']
  h = d // n
  out = [_vocab('transformer.wte.weight', m['vocab_size'], d, 'embed'),
         _same('transformer.wpe.weight', (m['max_len'], d), 'pos_embed'),
         _same('transformer.ln_f.weight', (d,), 'ln_final/scale'),
         _same('transformer.ln_f.bias', (d,), 'ln_final/bias')]
  for i in range(m['num_layers']):
    hf, zoo = f'transformer.h.{i}.', f'block_{i}/'
    qkv = tuple(f'{zoo}attn/{x}' for x in ('query', 'key', 'value'))
    out += [
        _same(f'{hf}ln_1.weight', (d,), f'{zoo}ln_attn/scale'),
        _same(f'{hf}ln_1.bias', (d,), f'{zoo}ln_attn/bias'),
        Tensor(f'{hf}attn.c_attn.weight', (d, 3 * d), qkv,
               lambda x: tuple(x[:, j * d:(j + 1) * d].reshape(d, n, h) for j in range(3)),
               lambda q, k, v: np.concatenate([y.reshape(d, d) for y in (q, k, v)], axis=1)),
        Tensor(f'{hf}attn.c_attn.bias', (3 * d,), tuple(p + '_bias' for p in qkv),
               lambda x: tuple(x[j * d:(j + 1) * d].reshape(n, h) for j in range(3)),
               lambda q, k, v: np.concatenate([y.reshape(d) for y in (q, k, v)])),
        Tensor(f'{hf}attn.c_proj.weight', (d, d), (f'{zoo}attn/out',),
               lambda x: (x.reshape(n, h, d),), lambda x: x.reshape(d, d)),
        _same(f'{hf}attn.c_proj.bias', (d,), f'{zoo}attn/out_bias'),
        _same(f'{hf}ln_2.weight', (d,), f'{zoo}ln_mlp/scale'),
        _same(f'{hf}ln_2.bias', (d,), f'{zoo}ln_mlp/bias'),
        _same(f'{hf}mlp.c_fc.weight', (d, f), f'{zoo}mlp/wi'),
        _same(f'{hf}mlp.c_fc.bias', (f,), f'{zoo}mlp/wi_bias'),
        _same(f'{hf}mlp.c_proj.weight', (f, d), f'{zoo}mlp/wo'),
        _same(f'{hf}mlp.c_proj.bias', (d,), f'{zoo}mlp/wo_bias')]
  return out


def _gpt2_matches(m):
  return (m.get('positions') == 'learned' and m.get('norm') == 'layer' and m.get('use_bias')
          and m.get('mlp_activation') == 'gelu' and m.get('tie_embeddings')
          and not m.get('num_kv_heads') and not m.get('head_dim'))


# Decoders in Llama's layout: Llama (1-3), Mistral, Qwen2/2.5, Qwen3, Gemma 1-3, and the
# mixtures of experts Mixtral, Qwen2-MoE and Qwen3-MoE (routed experts for MLPs). The same
# tensors (model.layers.N.self_attn.q_proj, ...), rotary positions and RMSNorm; each model
# type adds switches of zoo's Transformer (zoo.models.transformer).

def _rope(c: dict, model_type: str, kind: str = '') -> dict:
  """A config's rotary settings as zoo fields: transformers 5's rope_parameters (per layer
  type for Gemma 3: `kind`), or the older rope_theta and rope_scaling."""
  params = c.get('rope_parameters') or {}
  nested = any(isinstance(v, dict) for v in params.values())
  if nested:
    params = params.get(kind or 'full_attention') or {}
  elif kind == 'sliding_attention':  # transformers 4's Gemma 3: rope_local_base_freq.
    return {'rope_theta': float(c.get('rope_local_base_freq', 10000.0))}
  scaling = c.get('rope_scaling') or {}  # Older configs' scaling, for global layers.
  scaled = (scaling.get('rope_type') or scaling.get('type') or 'default') != 'default'
  merged = {**params, **scaling} if scaled and kind != 'sliding_attention' else params
  kind_of = merged.get('rope_type') or merged.get('type') or 'default'
  theta = float(merged.get('rope_theta', c.get('rope_theta', 10000.0)))
  if kind_of == 'default':
    return {'rope_theta': theta}
  if kind_of == 'linear':
    return {'rope_theta': theta, 'rope_scaling': 'linear', 'rope_factor': float(merged['factor'])}
  if kind_of == 'llama3':
    return {'rope_theta': theta, 'rope_scaling': 'llama3', 'rope_factor': float(merged['factor']),
            'rope_low_freq_factor': float(merged.get('low_freq_factor', 1.0)),
            'rope_high_freq_factor': float(merged.get('high_freq_factor', 4.0)),
            'rope_original_max_len': int(merged.get('original_max_position_embeddings')
                                         or c['max_position_embeddings'])}
  if kind_of == 'yarn':
    for key in ('mscale', 'mscale_all_dim'):  # DeepSeek's attention factor: not here.
      if merged.get(key):
        _refuse({f'rope_parameters.{key}': merged[key]}, model_type)
    if merged.get('truncate', True) is not True:
      _refuse({'rope_parameters.truncate': merged['truncate']}, model_type)
    original = int(merged.get('original_max_position_embeddings') or c['max_position_embeddings'])
    return {'rope_theta': theta, 'rope_scaling': 'yarn', 'rope_original_max_len': original,
            'rope_factor': float(merged.get('factor') or c['max_position_embeddings'] / original),
            'rope_beta_fast': float(merged.get('beta_fast') or 32.0),
            'rope_beta_slow': float(merged.get('beta_slow') or 1.0),
            'rope_attention_factor': float(merged.get('attention_factor') or 0.0)}
  _refuse({'rope_type': kind_of}, model_type)
  return {}


def _rope_to_hf(m: dict, local: bool = False) -> dict:
  if local:
    return {'rope_type': 'default', 'rope_theta': m['rope_local_theta']}
  out = {'rope_type': 'default', 'rope_theta': m['rope_theta']}
  if m.get('rope_scaling', 'none') == 'linear':
    out.update(rope_type='linear', factor=m['rope_factor'])
  elif m.get('rope_scaling') == 'llama3':
    out.update(rope_type='llama3', factor=m['rope_factor'],
               low_freq_factor=m['rope_low_freq_factor'],
               high_freq_factor=m['rope_high_freq_factor'],
               original_max_position_embeddings=m['rope_original_max_len'])
  elif m.get('rope_scaling') == 'yarn':
    out.update(rope_type='yarn', factor=m['rope_factor'], beta_fast=m['rope_beta_fast'],
               beta_slow=m['rope_beta_slow'],
               original_max_position_embeddings=m['rope_original_max_len'])
    if m.get('rope_attention_factor'):
      out['attention_factor'] = m['rope_attention_factor']
  return out


def _layer_pattern(c: dict, window: Optional[int], model_type: str) -> dict:
  """sliding_window and global_every from a config's window and layer_types (sliding layers
  where (i + 1) % global_every != 0, as Gemma 2 and 3 lay them out); other layouts refused."""
  layers = c['num_hidden_layers']
  types = c.get('layer_types')
  if not window:
    if types and any(t != 'full_attention' for t in types):
      _refuse({'layer_types': 'sliding layers without a sliding_window'}, model_type)
    return {'sliding_window': 0, 'global_every': 0}
  if not types:
    return {'sliding_window': int(window), 'global_every': 0}
  full = [i for i, t in enumerate(types) if t == 'full_attention']
  every = full[0] + 1 if full else 0
  if len(types) != layers or set(types) - {'full_attention', 'sliding_attention'} or full != [
      i for i in range(layers) if every and (i + 1) % every == 0]:
    _refuse({'layer_types': 'a pattern other than every n-th layer global'}, model_type)
  return {'sliding_window': int(window), 'global_every': every}


# Routed-experts layouts: their dense namesake's attention, and experts for MLPs.
MOE_BASES = {'mixtral': 'mistral', 'qwen2_moe': 'qwen2', 'qwen3_moe': 'qwen3'}


def _decoder_from_hf(model_type: str):
  """config.json -> zoo fields, for a model type in Llama's layout."""
  gemma = model_type.startswith('gemma')
  base = MOE_BASES.get(model_type, model_type)

  def from_hf(c):
    unsupported = {}
    if c.get('mlp_bias'):
      unsupported['mlp_bias'] = True
    if c.get('attention_bias') and base not in ('qwen2',):
      unsupported['attention_bias'] = True
    if c.get('pretraining_tp', 1) != 1:
      unsupported['pretraining_tp'] = c.get('pretraining_tp')
    act = c.get('hidden_activation') or c.get('hidden_act') or ('gelu_pytorch_tanh' if gemma
                                                                 else 'silu')
    want = ('gelu_pytorch_tanh', 'gelu') if gemma else ('silu',)
    if act not in want:  # transformers runs Gemma's 'gelu' as the tanh approximation.
      unsupported['hidden_act'] = act
    if c.get('use_bidirectional_attention'):
      unsupported['use_bidirectional_attention'] = True
    if base in ('qwen2', 'qwen3') and c.get('use_sliding_window'):
      unsupported['use_sliding_window'] = True
    if model_type == 'qwen2_moe' and not c.get('qkv_bias', True):  # transformers 5's switch.
      unsupported['qkv_bias'] = False
    _refuse(unsupported, model_type)
    heads, d = c['num_attention_heads'], c['hidden_size']
    head_dim = c.get('head_dim') or d // heads
    fields = dict(
        vocab_size=c['vocab_size'], num_layers=c['num_hidden_layers'], d_model=d, num_heads=heads,
        num_kv_heads=c.get('num_key_value_heads') or heads,
        head_dim=head_dim if head_dim * heads != d else 0, mlp_dim=c['intermediate_size'],
        max_len=c['max_position_embeddings'], positions='rotary',
        norm='rms_offset' if gemma else 'rms', norm_epsilon=c.get('rms_norm_eps', 1e-6),
        mlp_activation='geglu' if gemma else 'swiglu', use_bias=False,
        tie_embeddings=bool(c.get('tie_word_embeddings', gemma)),
        qkv_bias=base == 'qwen2', qk_norm=base in ('qwen3', 'gemma3_text'),
        post_norms=model_type in ('gemma2', 'gemma3_text'), embed_scale=gemma)
    if model_type == 'gemma3_text':
      fields.update(_rope(c, model_type, 'full_attention'))
      local = _rope(c, model_type, 'sliding_attention')
      if set(local) != {'rope_theta'}:
        _refuse({'rope_parameters.sliding_attention': local}, model_type)
      fields['rope_local_theta'] = local['rope_theta']
    else:
      fields.update(_rope(c, model_type))
    if model_type in ('gemma2', 'gemma3_text'):
      fields['query_scale_dim'] = int(c.get('query_pre_attn_scalar') or head_dim)
      fields['final_softcap'] = float(c.get('final_logit_softcapping') or 0.0)
    if model_type == 'gemma2':  # Gemma 3's attention ignores attn_logit_softcapping.
      fields['attn_softcap'] = float(c.get('attn_logit_softcapping') or 0.0)
    window = c.get('sliding_window') if base in ('mistral', 'gemma2', 'gemma3_text') else None
    fields.update(_layer_pattern(c, window, model_type))
    if model_type in MOE_BASES:
      fields.update(_experts_from_hf(c, model_type))
    return fields
  return from_hf


def _experts_from_hf(c: dict, model_type: str) -> dict:
  """A routed-experts config's expert fields. Mixtral routes every layer, renormalising
  the chosen gates; Qwen2/3-MoE route layer i where (i + 1) % decoder_sparse_step == 0 and i
  is not in mlp_only_layers, renormalising only if norm_topk_prob, Qwen2-MoE adding a gated
  shared expert. Published Qwen3-MoE files name the count num_experts, transformers 5's
  saves num_local_experts."""
  if c.get('router_jitter_noise'):
    _refuse({'router_jitter_noise': c['router_jitter_noise']}, model_type)
  count = 'num_local_experts' if model_type == 'mixtral' else 'num_experts'
  width = 'intermediate_size' if model_type == 'mixtral' else 'moe_intermediate_size'
  experts = c.get('num_experts') or c.get('num_local_experts')
  missing = [k for k, v in ((count, experts), ('num_experts_per_tok', c.get('num_experts_per_tok')),
                            (width, c.get(width))) if not v]
  if missing:
    raise ConfigError(f'--hf_dir: this {model_type} config.json has no {", ".join(missing)}: a '
                      'model with routed experts names how many, how many per token and their '
                      'width (save the model with transformers)')
  fields = dict(num_experts=experts, experts_per_token=c['num_experts_per_tok'],
                router_aux_coef=float(c.get('router_aux_loss_coef', 0.001)), router_z_coef=0.0)
  if model_type == 'mixtral':
    return {**fields, 'expert_mlp_dim': c['intermediate_size'], 'norm_topk_prob': True}
  step, only = c.get('decoder_sparse_step', 1) or 1, set(c.get('mlp_only_layers') or ())
  dense = [i for i in range(c['num_hidden_layers']) if i in only or (i + 1) % step]
  return {**fields, 'expert_mlp_dim': c['moe_intermediate_size'], 'dense_layers': dense,
          'norm_topk_prob': bool(c.get('norm_topk_prob', False)),
          'shared_expert_dim': c.get('shared_expert_intermediate_size', 0)
          if model_type == 'qwen2_moe' else 0}


_HF_CLASS = {'mixtral': 'MixtralForCausalLM', 'qwen2_moe': 'Qwen2MoeForCausalLM',
             'qwen3_moe': 'Qwen3MoeForCausalLM',
             'llama': 'LlamaForCausalLM', 'mistral': 'MistralForCausalLM',
             'qwen2': 'Qwen2ForCausalLM', 'qwen3': 'Qwen3ForCausalLM', 'gemma': 'GemmaForCausalLM',
             'gemma2': 'Gemma2ForCausalLM', 'gemma3_text': 'Gemma3ForCausalLM'}


def _decoder_to_hf(model_type: str):
  """zoo fields -> config.json, for a model type in Llama's layout."""
  gemma = model_type.startswith('gemma')
  base = MOE_BASES.get(model_type, model_type)

  def to_hf(m):
    heads = m['num_heads']
    head_dim = m.get('head_dim') or m['d_model'] // heads
    c = dict(architectures=[_HF_CLASS[model_type]], model_type=model_type,
             vocab_size=m['vocab_size'], hidden_size=m['d_model'], intermediate_size=m['mlp_dim'],
             num_hidden_layers=m['num_layers'], num_attention_heads=heads,
             num_key_value_heads=m.get('num_kv_heads') or heads, head_dim=head_dim,
             max_position_embeddings=m['max_len'], rms_norm_eps=m['norm_epsilon'],
             tie_word_embeddings=bool(m.get('tie_embeddings')))
    if gemma:
      c['hidden_activation'] = 'gelu_pytorch_tanh'
    else:
      c.update(hidden_act='silu', mlp_bias=False)
    if base in ('llama', 'qwen3'):
      c['attention_bias'] = False
    if model_type == 'gemma3_text':
      c['rope_parameters'] = {'full_attention': _rope_to_hf(m),
                              'sliding_attention': _rope_to_hf(m, local=True)}
    elif m.get('rope_scaling', 'none') != 'none' or base != 'llama':
      c['rope_parameters'] = _rope_to_hf(m)
    else:
      c['rope_theta'] = m['rope_theta']
    if base in ('qwen2', 'qwen3'):
      c['use_sliding_window'] = False
    if model_type in ('gemma2', 'gemma3_text'):
      c['query_pre_attn_scalar'] = m.get('query_scale_dim') or head_dim
      c['final_logit_softcapping'] = m.get('final_softcap') or None
      c['attn_logit_softcapping'] = m.get('attn_softcap') or None
    if base in ('mistral', 'gemma2', 'gemma3_text'):
      c['sliding_window'] = m.get('sliding_window') or None
      if base != 'mistral':
        every = m.get('global_every') or 0
        c['layer_types'] = ['sliding_attention' if every and (i + 1) % every else 'full_attention'
                            for i in range(m['num_layers'])]
    if model_type in MOE_BASES:
      c.update(_experts_to_hf(m, model_type))
    return c
  return to_hf


def _expert_dim(m: dict) -> int:
  """Each expert's hidden units (zoo's expert_mlp_dim; 0: mlp_dim)."""
  return m['expert_mlp_dim'] or m['mlp_dim']


def _experts_to_hf(m: dict, model_type: str) -> dict:
  c = dict(num_experts_per_tok=m['experts_per_token'],
           router_aux_loss_coef=m['router_aux_coef'], output_router_logits=False)
  if model_type == 'mixtral':
    return {**c, 'num_local_experts': m['num_experts'], 'intermediate_size': _expert_dim(m),
            'router_jitter_noise': 0.0}
  c.update(num_experts=m['num_experts'], moe_intermediate_size=_expert_dim(m),
           decoder_sparse_step=1, mlp_only_layers=sorted(m.get('dense_layers') or ()),
           norm_topk_prob=bool(m['norm_topk_prob']))
  if model_type == 'qwen2_moe':
    c['shared_expert_intermediate_size'] = m['shared_expert_dim']
  return c


def _expert_tensors(m: dict, model_type: str, hf: str, zoo: str) -> list:
  """A routed layer's router, each expert's three projections (rows of zoo's [E, D, F]
  and [E, F, D] parameters) and Qwen2-MoE's shared expert and its gate."""
  d, e, f = m['d_model'], m['num_experts'], _expert_dim(m)
  moe = f'{hf}block_sparse_moe.' if model_type == 'mixtral' else f'{hf}mlp.'
  names = (('w1', 'w3', 'w2') if model_type == 'mixtral' else
           ('gate_proj', 'up_proj', 'down_proj'))
  out = [_transposed(f'{moe}gate.weight', (e, d), f'{zoo}moe/router')]
  for i in range(e):
    for name, path, shape in zip(names, ('wi_gate', 'wi_up', 'wo'), ((f, d), (f, d), (d, f))):
      out.append(dataclasses.replace(
          _transposed(f'{moe}experts.{i}.{name}.weight', shape, f'{zoo}moe/{path}'), expert=i))
  if m.get('shared_expert_dim'):
    out += _mlp_tensors(f'{moe}shared_expert.', f'{zoo}shared_expert/', d, m['shared_expert_dim'])
    out.append(Tensor(f'{moe}shared_expert_gate.weight', (1, d), (f'{zoo}shared_gate',),
                      lambda x: (x[0],), lambda x: x[None]))
  return out


def _mlp_tensors(hf: str, zoo: str, d: int, f: int) -> list:
  return [_transposed(f'{hf}gate_proj.weight', (f, d), f'{zoo}wi_gate'),
          _transposed(f'{hf}up_proj.weight', (f, d), f'{zoo}wi_up'),
          _transposed(f'{hf}down_proj.weight', (d, f), f'{zoo}wo')]


def _decoder_tensors(model_type: str):
  """zoo fields -> [Tensor], for a model type in Llama's layout."""
  return lambda m: _llama_tensors(m, model_type)


def _llama_tensors(m, model_type):
  d, n, f = m['d_model'], m['num_heads'], m['mlp_dim']
  g, h = m.get('num_kv_heads') or n, m.get('head_dim') or d // n
  out = [_vocab('model.embed_tokens.weight', m['vocab_size'], d, 'embed'),
         _same('model.norm.weight', (d,), 'ln_final/scale')]
  if not m.get('tie_embeddings'):
    out.append(_vocab('lm_head.weight', m['vocab_size'], d, 'head', transposed=True))
  for i in range(m['num_layers']):
    hf, zoo = f'model.layers.{i}.', f'block_{i}/'
    out += [
        _same(f'{hf}input_layernorm.weight', (d,), f'{zoo}ln_attn/scale'),
        _heads_in(f'{hf}self_attn.q_proj.weight', (n * h, d), f'{zoo}attn/query', n, h),
        _heads_in(f'{hf}self_attn.k_proj.weight', (g * h, d), f'{zoo}attn/key', g, h),
        _heads_in(f'{hf}self_attn.v_proj.weight', (g * h, d), f'{zoo}attn/value', g, h),
        _heads_out(f'{hf}self_attn.o_proj.weight', (d, n * h), f'{zoo}attn/out', n, h)]
    routed = m.get('num_experts') and i not in set(m.get('dense_layers') or ())
    out += (_expert_tensors(m, model_type, hf, zoo) if routed else
            _mlp_tensors(f'{hf}mlp.', f'{zoo}mlp/', d, f))
    if m.get('qkv_bias'):
      out += [_bias_heads(f'{hf}self_attn.{x}_proj.bias', heads, h, f'{zoo}attn/{name}_bias')
              for x, name, heads in (('q', 'query', n), ('k', 'key', g), ('v', 'value', g))]
    if m.get('qk_norm'):
      out += [_same(f'{hf}self_attn.{x}_norm.weight', (h,), f'{zoo}attn/{name}_norm/scale')
              for x, name in (('q', 'query'), ('k', 'key'))]
    if m.get('post_norms'):
      out += [_same(f'{hf}post_attention_layernorm.weight', (d,), f'{zoo}ln_attn_out/scale'),
              _same(f'{hf}pre_feedforward_layernorm.weight', (d,), f'{zoo}ln_mlp/scale'),
              _same(f'{hf}post_feedforward_layernorm.weight', (d,), f'{zoo}ln_mlp_out/scale')]
    else:
      out.append(_same(f'{hf}post_attention_layernorm.weight', (d,), f'{zoo}ln_mlp/scale'))
  return out


def _decoder_matches(model_type: str):
  """Whether zoo fields (defaults included) are this model type's layout: its dense
  namesake's attention, norms and embeddings, and routed experts iff it has them."""
  gemma = model_type.startswith('gemma')
  dense_type = MOE_BASES.get(model_type, model_type)

  def matches(m):
    # (A capacity factor or expert buffer is how training routed: the weights are the same.)
    if bool(m.get('num_experts')) != (model_type in MOE_BASES):
      return False
    if model_type == 'mixtral' and (not m.get('norm_topk_prob') or m.get('dense_layers')):
      return False
    if bool(m.get('shared_expert_dim')) != (model_type == 'qwen2_moe'):
      return False
    base = (m.get('positions') == 'rotary' and not m.get('use_bias')
            and m.get('norm') == ('rms_offset' if gemma else 'rms')
            and m.get('mlp_activation') == ('geglu' if gemma else 'swiglu')
            and bool(m.get('embed_scale')) == gemma
            and bool(m.get('qkv_bias')) == (dense_type == 'qwen2')
            and bool(m.get('qk_norm')) == (dense_type in ('qwen3', 'gemma3_text'))
            and bool(m.get('post_norms')) == (dense_type in ('gemma2', 'gemma3_text'))
            and bool(m.get('rope_local_theta')) == (dense_type == 'gemma3_text')
            and (dense_type == 'gemma2' or not m.get('attn_softcap'))
            and (dense_type in ('gemma2', 'gemma3_text')
                 or not m.get('final_softcap') and not m.get('query_scale_dim'))
            and (not gemma or m.get('tie_embeddings')))
    if model_type == 'mixtral':  # Mistral's attention, with or without its window.
      return base and not m.get('global_every')
    if dense_type == 'mistral':
      return base and bool(m.get('sliding_window')) and not m.get('global_every')
    if dense_type in ('gemma2', 'gemma3_text'):
      return base
    return base and not m.get('sliding_window')
  return matches


# ViT (ViTForImageClassification): patches, class token, pre-norm blocks with biases, head.

def _vit_from_hf(c):
  unsupported = {}
  if c.get('hidden_act', 'gelu') != 'gelu':
    unsupported['hidden_act'] = c.get('hidden_act')
  if not c.get('qkv_bias', True):
    unsupported['qkv_bias'] = False
  _refuse(unsupported, 'vit')
  labels = c.get('id2label') or {}
  return dict(patch_size=c['patch_size'], num_layers=c['num_hidden_layers'],
              d_model=c['hidden_size'], num_heads=c['num_attention_heads'],
              mlp_dim=c['intermediate_size'], num_classes=c.get('num_labels') or len(labels) or 2,
              pool='cls', norm='layer', norm_epsilon=c.get('layer_norm_eps', 1e-12),
              mlp_activation='gelu_exact', use_bias=True,
              image_size=c['image_size'], num_channels=c.get('num_channels', 3))


def _vit_to_hf(m):
  return dict(architectures=['ViTForImageClassification'], model_type='vit',
              image_size=m['image_size'], patch_size=m['patch_size'],
              num_channels=m['num_channels'], hidden_size=m['d_model'],
              num_hidden_layers=m['num_layers'], num_attention_heads=m['num_heads'],
              intermediate_size=m['mlp_dim'], hidden_act='gelu', layer_norm_eps=m['norm_epsilon'],
              qkv_bias=True, id2label={str(i): str(i) for i in range(m['num_classes'])},
              label2id={str(i): i for i in range(m['num_classes'])},
              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _vit_tensors(m):
  d, n, f, p, c = m['d_model'], m['num_heads'], m['mlp_dim'], m['patch_size'], m['num_channels']
  h = d // n
  patches = (m['image_size'] // p) ** 2
  out = [Tensor('vit.embeddings.cls_token', (1, 1, d), ('cls',), lambda x: (x,), lambda x: x),
         Tensor('vit.embeddings.position_embeddings', (1, patches + 1, d), ('pos_embed',),
                lambda x: (x[0],), lambda x: x[None]),
         Tensor('vit.embeddings.patch_embeddings.projection.weight', (d, c, p, p),
                ('patch_embed/kernel',), lambda x: (x.transpose(2, 3, 1, 0),),
                lambda x: x.transpose(3, 2, 0, 1)),
         _same('vit.embeddings.patch_embeddings.projection.bias', (d,), 'patch_embed/bias'),
         _same('vit.layernorm.weight', (d,), 'ln_final/scale'),
         _same('vit.layernorm.bias', (d,), 'ln_final/bias'),
         _transposed('classifier.weight', (m['num_classes'], d), 'head/kernel'),
         _same('classifier.bias', (m['num_classes'],), 'head/bias')]
  for i in range(m['num_layers']):
    hf, zoo = f'vit.encoder.layer.{i}.', f'block_{i}/'
    for x in ('query', 'key', 'value'):
      out += [_heads_in(f'{hf}attention.attention.{x}.weight', (d, d), f'{zoo}attn/{x}', n, h),
              _bias_heads(f'{hf}attention.attention.{x}.bias', n, h, f'{zoo}attn/{x}_bias')]
    out += [
        _heads_out(f'{hf}attention.output.dense.weight', (d, d), f'{zoo}attn/out', n, h),
        _same(f'{hf}attention.output.dense.bias', (d,), f'{zoo}attn/out_bias'),
        _same(f'{hf}layernorm_before.weight', (d,), f'{zoo}ln_attn/scale'),
        _same(f'{hf}layernorm_before.bias', (d,), f'{zoo}ln_attn/bias'),
        _same(f'{hf}layernorm_after.weight', (d,), f'{zoo}ln_mlp/scale'),
        _same(f'{hf}layernorm_after.bias', (d,), f'{zoo}ln_mlp/bias'),
        _transposed(f'{hf}intermediate.dense.weight', (f, d), f'{zoo}mlp/wi'),
        _same(f'{hf}intermediate.dense.bias', (f,), f'{zoo}mlp/wi_bias'),
        _transposed(f'{hf}output.dense.weight', (d, f), f'{zoo}mlp/wo'),
        _same(f'{hf}output.dense.bias', (d,), f'{zoo}mlp/wo_bias')]
  return out


def _vit_matches(m):
  return m.get('use_bias') and m.get('mlp_activation') == 'gelu_exact' and m.get('pool') == 'cls'


def _vit_image(fields: dict, params: dict) -> dict:
  """The image a ViT takes, read off its parameters: channels from the patch kernel, size
  from the positions (one per patch, plus the class token)."""
  kernel, positions = params['patch_embed/kernel'], params['pos_embed']
  return {**fields, 'num_channels': kernel.shape[2],
          'image_size': fields['patch_size'] * math.isqrt(positions.shape[0] - 1)}


def _decoder(model_type: str) -> 'Architecture':
  return Architecture(_HF_CLASS[model_type], 'transformer_lm', TEXT, _decoder_from_hf(model_type),
                      _decoder_to_hf(model_type), _decoder_tensors(model_type),
                      _decoder_matches(model_type),
                      ignored=('.rotary_emb.inv_freq',))


# Export picks the first layout a model's fields match: the most specific first.
ARCHITECTURES = {
    'gpt2': Architecture('GPT2LMHeadModel', 'transformer_lm', TEXT, _gpt2_from_hf, _gpt2_to_hf,
                         _gpt2_tensors, _gpt2_matches,
                         ignored=('.attn.bias', '.attn.masked_bias', 'lm_head.weight')),
    **{t: _decoder(t) for t in ('mixtral', 'qwen2_moe', 'qwen3_moe', 'gemma3_text', 'gemma2',
                                'gemma', 'qwen3', 'qwen2', 'mistral', 'llama')},
    'vit': Architecture('ViTForImageClassification', 'vit', IMAGES, _vit_from_hf, _vit_to_hf,
                        _vit_tensors, _vit_matches,
                        ignored=('vit.pooler.dense.weight', 'vit.pooler.dense.bias'),
                        from_params=_vit_image),
}


def _refuse(unsupported: dict, model_type: str) -> None:
  if unsupported:
    settings = ', '.join(f'{k}={v!r}' for k, v in unsupported.items())
    raise ConfigError(f'--hf_dir: this {model_type} model uses {settings}, which zoo does not '
                      'implement (config.json); docs/pretrained.md lists what each supported '
                      'layout covers')


def architecture(hf_config: dict) -> tuple[str, 'Architecture']:
  """The HF config's model type and its Architecture; ConfigError listing the supported."""
  model_type = hf_config.get('model_type')
  if model_type not in ARCHITECTURES:
    raise ConfigError(f'--hf_dir: model_type {model_type!r} is not supported; supported: '
                      f'{", ".join(sorted(ARCHITECTURES))}')
  return model_type, ARCHITECTURES[model_type]


def with_defaults(model_config: dict) -> dict:
  """config.model's fields, completed with its family module's defaults."""
  from zoo import models  # pylint: disable=import-outside-toplevel
  family = models.MODELS.get(model_config.get('name'))
  if family is None:
    return dict(model_config)
  defaults = {f.name: f.default for f in dataclasses.fields(family.module)
              if f.default is not dataclasses.MISSING and f.name not in ('parent', 'name')}
  return {**defaults, **model_config}


def architecture_of(model_config: dict) -> Optional[tuple[str, 'Architecture']]:
  """The HF layout a zoo model's fields (defaults included) match, if any."""
  fields = with_defaults(model_config)
  for model_type, arch in ARCHITECTURES.items():
    if fields.get('name') == arch.family and arch.matches(fields):
      return model_type, arch
  return None
