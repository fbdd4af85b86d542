"""Today's open model families in and out: tiny random Qwen2, Qwen3, Mistral, Llama 3 (rope
scaling), Gemma, Gemma 2 and Gemma 3 built by `transformers`, imported (logits within 1e-4 of
transformers', float32), decoded greedily through zoo's key/value cache (the tokens of
transformers' `generate`), exported (every tensor bit-identical, config.json loads back),
run with their layers under nn.scan, and each unsupported switch refused in one line.

Each family's distinguishing switches are on, at sizes where they matter: windows of 4
positions in 14-token inputs, weights drawn wider than transformers' default (norm scales
and soft caps near 0.02-scale weights change almost nothing)."""
import json
import os
import shutil

import jax
import numpy as np
import pytest

from zoo.data import tokenizer as tokenizer_lib
from zoo.errors import ConfigError
from zoo.hf import layouts, transfer
from zoo.parallel import mesh as mesh_lib
from zoo.parallel import sharding
from zoo.run import sampling
from zoo.run import setup as setup_lib
from zoo.store import checkpoint

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

VOCAB = 257
LOGITS = dict(atol=1e-4, rtol=1e-4)  # The bound; measured differences are ~1e-6.
_B = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
          num_key_value_heads=2, max_position_embeddings=64, bos_token_id=256, eos_token_id=256,
          pad_token_id=0)


def _families():
  t = transformers
  return {
      # q/k/v biases, tied embeddings.
      'qwen2': (t.Qwen2ForCausalLM, t.Qwen2Config(**_B, num_hidden_layers=2,
                                                   tie_word_embeddings=True)),
      # q/k RMSNorm, a head size independent of the width.
      'qwen3': (t.Qwen3ForCausalLM, t.Qwen3Config(**_B, num_hidden_layers=2, head_dim=32)),
      # Every layer sliding.
      'mistral': (t.MistralForCausalLM, t.MistralConfig(**_B, num_hidden_layers=2,
                                                        sliding_window=4)),
      # Llama 3's rope scaling: wavelengths on both sides of the ramp and in it.
      'llama3': (t.LlamaForCausalLM, t.LlamaConfig(**_B, num_hidden_layers=2, rope_parameters={
          'rope_type': 'llama3', 'rope_theta': 10000.0, 'factor': 8.0, 'low_freq_factor': 1.0,
          'high_freq_factor': 4.0, 'original_max_position_embeddings': 32})),
      # GeGLU, (1 + w) RMSNorm, sqrt(d) embedding scale, head size 24 of width 64.
      'gemma': (t.GemmaForCausalLM, t.GemmaConfig(**_B, num_hidden_layers=2, head_dim=24)),
      # Soft caps, sliding and global layers alternating, post-norms, its query scale.
      'gemma2': (t.Gemma2ForCausalLM, t.Gemma2Config(
          **_B, num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=24, sliding_window=4,
          attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
      # q/k (1 + w) norms, a second rope base for local layers, scaled global rope.
      'gemma3': (t.Gemma3ForCausalLM, t.Gemma3TextConfig(
          **_B, num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=24, sliding_window=4,
          layer_types=['sliding_attention', 'sliding_attention', 'full_attention',
                       'sliding_attention'], final_logit_softcapping=3.0,
          rope_parameters={'sliding_attention': {'rope_type': 'default', 'rope_theta': 10000.0},
                           'full_attention': {'rope_type': 'linear', 'factor': 2.0,
                                              'rope_theta': 1000000.0}})),
  }


def _widen(model):
  """Weights drawn so that every switch moves the logits (transformers draws 0.02 and
  norms of exactly 1): matrices N(0, 0.25), embeddings N(0, 0.5), biases N(0, 0.3), norm
  weights 1 + N(0, 0.3) (Gemma's, stored as the offset from 1: N(0, 0.3))."""
  gen = torch.Generator().manual_seed(1)
  offset = model.config.model_type.startswith('gemma')
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      if 'embed' in name:
        p.copy_(noise * 0.5)
      elif p.ndim == 2:
        p.copy_(noise * 0.25)
      elif 'norm' in name and not offset:
        p.copy_(1 + noise * 0.3)
      else:
        p.copy_(noise * 0.3)
  return model


@pytest.fixture(scope='module')
def families(tmp_path_factory):
  """name -> (hf dir, torch model, zoo workdir, its Setup): each family saved and imported."""
  root = tmp_path_factory.mktemp('families')
  out = {}
  for name, (cls, config) in _families().items():
    torch.manual_seed(0)
    model = _widen(cls(config).eval())
    model.save_pretrained(root / name)
    tokenizer_lib.bytes_tokenizer().save(str(root / name / 'tokenizer.json'))
    workdir = str(root / f'{name}_zoo')
    out[name] = (str(root / name), model, workdir, transfer.import_model(str(root / name), workdir))
  return out


def _tokens(length=14, batch=2):
  return np.random.default_rng(0).integers(0, VOCAB, size=(batch, length)).astype(np.int32)


def _hf_logits(model, x):
  with torch.no_grad():
    return model(torch.tensor(x, dtype=torch.long)).logits.numpy()


def _zoo_logits(setup, workdir, x, params=None):
  with setup.scope():
    if params is None:
      params, _, _ = checkpoint.restore_params(workdir, setup.abstract_state().params)
    logits = jax.jit(lambda p, x: setup.model.apply({'params': p}, x))(params, x)
  return np.asarray(logits)[..., :VOCAB]


NAMES = list(_families())


@pytest.mark.parametrize('name', NAMES)
def test_imported_logits_equal_transformers_on_a_mesh(name, families, devices):
  hf_dir, model, workdir, placed = families[name]
  del hf_dir
  mesh = mesh_lib.make_mesh((4, 2), ('batch', 'model'), devices)
  rules = sharding.fit_rules(placed.logical_state.params, mesh, placed.config.logical_axis_rules)
  setup = setup_lib.build(placed.config, placed.dataset, mesh=mesh, rules=rules)
  x = _tokens()
  want = _hf_logits(model, x)
  got = _zoo_logits(setup, workdir, x)
  np.testing.assert_allclose(got, want, **LOGITS)
  assert np.abs(want).max() > 1.0  # Logits large enough that a missing switch shows.


def test_scaled_rope_past_the_original_context_equals_transformers(families, tmp_path, devices):
  """Context extension: Llama 3's scaling (trained on 32 positions) and YaRN (a Qwen2 of
  16 original positions, factor 4, its attention factor) imported, logits within 1e-4 of
  transformers' over 48 positions, past both original contexts."""
  del devices
  x = _tokens(length=48)
  _, llama, workdir, placed = families['llama3']
  np.testing.assert_allclose(_zoo_logits(placed, workdir, x), _hf_logits(llama, x), **LOGITS)
  torch.manual_seed(0)
  yarn = _widen(transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
      **_B, num_hidden_layers=2, rope_parameters={
          'rope_type': 'yarn', 'rope_theta': 10000.0, 'factor': 4.0,
          'original_max_position_embeddings': 16})).eval())
  yarn.save_pretrained(tmp_path / 'yarn')
  tokenizer_lib.bytes_tokenizer().save(str(tmp_path / 'yarn' / 'tokenizer.json'))
  setup = transfer.import_model(str(tmp_path / 'yarn'), str(tmp_path / 'run'))
  assert setup.config.model.rope_scaling == 'yarn' and setup.config.model.rope_factor == 4.0
  want = _hf_logits(yarn, x)
  np.testing.assert_allclose(_zoo_logits(setup, str(tmp_path / 'run'), x), want, **LOGITS)
  assert np.abs(want).max() > 1.0


@pytest.mark.parametrize('name', NAMES)
def test_greedy_decoding_through_the_cache_equals_generate(name, families, devices):
  """Prompts of 9 and 3 bytes and 16 new tokens (past the window of 4): the cached prefill and
  single-token steps pick transformers' tokens."""
  del devices
  _, model, workdir, _ = families[name]
  samples = sampling.generate(workdir, ['Hello wor', 'abc'], 16, temperature=0.0)
  for s in samples:
    ids = torch.tensor([s['prompt_ids']])
    with torch.no_grad():
      want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                            do_sample=False, eos_token_id=None, pad_token_id=0)
    assert s['ids'] == want[0, ids.shape[1]:].tolist(), name


@pytest.mark.parametrize('name', NAMES)
def test_export_round_trips_bit_for_bit(name, families, tmp_path):
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  hf_dir, model, workdir, _ = families[name]
  out = tmp_path / 'exported'
  model_type = transfer.export_model(workdir, str(out))
  assert model_type == json.loads(open(os.path.join(hf_dir, 'config.json')).read())['model_type']
  with safe_open(os.path.join(hf_dir, 'model.safetensors'), 'np') as a, \
      safe_open(str(out / 'model.safetensors'), 'np') as b:
    assert set(a.keys()) == set(b.keys())
    for key in a.keys():
      np.testing.assert_array_equal(a.get_tensor(key), b.get_tensor(key), err_msg=key)
  cls = _families()[name][0]
  reloaded = cls.from_pretrained(str(out)).eval()
  x = _tokens()
  np.testing.assert_array_equal(_hf_logits(reloaded, x), _hf_logits(model, x))


@pytest.mark.parametrize('name', ['gemma2', 'gemma3'])
def test_layers_under_scan_compute_the_same(name, families, devices):
  """Local and global layers alternate: under nn.scan each layer's flag is scanned over
  (the window and, for Gemma 3, the rope base chosen per layer at run time)."""
  del devices
  _, model, workdir, placed = families[name]
  config = placed.config.copy_and_resolve_references()
  config.model.scan_layers = True
  setup = setup_lib.build(config, placed.dataset, mesh=placed.mesh, rules=placed.rules)
  with placed.scope():
    params, _, _ = checkpoint.restore_params(workdir, placed.abstract_state().params)
  layers = [params[f'block_{i}'] for i in range(config.model.num_layers)]
  stacked = {k: v for k, v in params.items() if not k.startswith('block_')}
  stacked['blocks'] = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *layers)
  x = _tokens()
  np.testing.assert_allclose(_zoo_logits(setup, workdir, x, stacked), _hf_logits(model, x),
                             **LOGITS)


def _edited(hf_dir, tmp_path, edit):
  path = tmp_path / 'edited'
  shutil.copytree(hf_dir, path)
  config = json.loads((path / 'config.json').read_text())
  edit(config)
  (path / 'config.json').write_text(json.dumps(config))
  return str(path)


@pytest.mark.parametrize('name,edit,message', [
    ('qwen2', lambda c: c.update(use_sliding_window=True, sliding_window=4),
     r"this qwen2 model uses use_sliding_window=True, which zoo does not implement"),
    ('qwen3', lambda c: c.update(attention_bias=True),
     r"this qwen3 model uses attention_bias=True"),
    ('gemma2', lambda c: c.update(layer_types=['full_attention', 'sliding_attention'] * 2),
     r"this gemma2 model uses layer_types='a pattern other than every n-th layer global'"),
    ('llama3', lambda c: c['rope_parameters'].update(rope_type='longrope'),
     r"this llama model uses rope_type='longrope'"),
    ('gemma', lambda c: c.update(hidden_activation='relu'),
     r"this gemma model uses hidden_act='relu'"),
    ('mistral', lambda c: c.update(model_type='olmoe'),
     r"model_type 'olmoe' is not supported; supported: gemma, gemma2, gemma3_text, gpt2, "
     r'llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe, vit'),
    ('mistral', lambda c: c.update(model_type='mixtral'),  # Without its experts' keys.
     r"this mixtral config.json has no num_local_experts, num_experts_per_tok: a model with "
     r'routed experts'),
])
def test_an_unsupported_switch_is_one_line_naming_the_field(name, edit, message, families,
                                                            tmp_path):
  hf_dir = families[name][0]
  with pytest.raises(ConfigError, match=r'^--hf_dir: ' + message):
    transfer.import_model(_edited(hf_dir, tmp_path, edit), str(tmp_path / 'run'))
  assert not (tmp_path / 'run').exists()


def test_export_picks_the_most_specific_layout():
  """A zoo model's fields name one layout each: Llama's fields with a window are Mistral's,
  with q/k/v biases Qwen2's, with Gemma's norm and embedding scale Gemma's."""
  llama = dict(name='transformer_lm', positions='rotary', norm='rms', mlp_activation='swiglu',
               tie_embeddings=False)
  gemma = {**llama, 'norm': 'rms_offset', 'mlp_activation': 'geglu', 'embed_scale': True,
           'tie_embeddings': True}
  for fields, want in ((llama, 'llama'), ({**llama, 'sliding_window': 8}, 'mistral'),
                       ({**llama, 'qkv_bias': True}, 'qwen2'),
                       ({**llama, 'qk_norm': True}, 'qwen3'),
                       (gemma, 'gemma'), ({**gemma, 'post_norms': True}, 'gemma2'),
                       ({**gemma, 'post_norms': True, 'qk_norm': True, 'rope_local_theta': 1e4},
                        'gemma3_text'), ({**llama, 'embed_scale': True}, None)):
    found = layouts.architecture_of(fields)
    assert (found and found[0]) == want, (fields, found)
