"""Mixtures of experts in and out of Hugging Face: tiny random Mixtral, Qwen2-MoE (a gated
shared expert, dense layers, norm_topk_prob false and true) and Qwen3-MoE (q/k norms,
mlp_only_layers, norm_topk_prob false and true) built by `transformers`, imported (logits
equal HF's, also with the experts split over an expert mesh axis), exported bit for bit,
each device's share of the experts read without the whole stack, and fine-tuned (full and
LoRA, exported to PEFT) like a dense import."""
import json
import os
import shutil

import jax
import numpy as np
import pytest

from conftest import experiment, prepared_text, read_metrics, saved_hf_models
from zoo import data as data_lib
from zoo.errors import ConfigError
from zoo.hf import transfer
from zoo.parallel import mesh as mesh_lib
from zoo.parallel import sharding
from zoo.run import setup as setup_lib
from zoo.store import checkpoint

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

VOCAB = 257  # zoo's bytes tokenizer.
# float32 against transformers: measured at most 1.4e-5 (Mixtral) on logits of up to ~7
# (the experts' weighted sum rounds differently from torch's).
LOGITS = dict(atol=3e-5, rtol=1e-5)
_ATTENTION = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                  bos_token_id=256, eos_token_id=256, initializer_range=0.2)


def _hf_models():
  qwen = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
              intermediate_size=48, router_aux_loss_coef=0.005, **_ATTENTION)
  return {
      'mixtral': (transformers.MixtralForCausalLM, transformers.MixtralConfig(
          num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
          router_aux_loss_coef=0.02, **_ATTENTION)),
      'qwen2_moe': (transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig(
          shared_expert_intermediate_size=40, norm_topk_prob=False, mlp_only_layers=[1], **qwen)),
      'qwen2_moe_norm': (transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig(
          shared_expert_intermediate_size=40, norm_topk_prob=True, decoder_sparse_step=2,
          **qwen)),
      'qwen3_moe': (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
          norm_topk_prob=True, mlp_only_layers=[0], **qwen)),
      'qwen3_moe_unnormed': (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
          norm_topk_prob=False, **qwen)),
  }


@pytest.fixture(scope='module')
def hf_dirs(tmp_path_factory):
  """Each tiny model saved by transformers; one Qwen3-MoE's config.json names its expert
  count as published files do (num_experts; transformers 5 saves num_local_experts)."""
  out = saved_hf_models(_hf_models(), tmp_path_factory.mktemp('hf_moe'))
  path = os.path.join(out['qwen3_moe_unnormed'][0], 'config.json')
  with open(path, encoding='utf-8') as f:
    config = json.load(f)
  config['num_experts'] = config.pop('num_local_experts')
  with open(path, 'w', encoding='utf-8') as f:
    json.dump(config, f)
  return out


@pytest.fixture(scope='module')
def imported(hf_dirs, tmp_path_factory):
  root = tmp_path_factory.mktemp('imported_moe')
  return {name: (str(root / name), transfer.import_model(path, str(root / name), '4,2'))
          for name, (path, _) in hf_dirs.items()}


@pytest.fixture(scope='module')
def ft_data(imported, tmp_path_factory):
  """What both fine-tunes of the imported Qwen3-MoE train on: zoo.prepare's token data in
  its tokenizer."""
  return prepared_text(imported['qwen3_moe'][0], tmp_path_factory.mktemp('ft'))


def _logits(setup, workdir, x):
  with setup.scope():
    params, _, _ = checkpoint.restore_params(workdir, setup.abstract_state().params)
    logits = jax.jit(lambda p, x: setup.model.apply({'params': p}, x))(params, x)
  return np.asarray(logits)[..., :VOCAB]


def _hf_logits(model, x):
  with torch.no_grad():
    return model(torch.tensor(x, dtype=torch.long)).logits.numpy()


X = np.random.default_rng(0).integers(0, VOCAB, size=(4, 12)).astype(np.int32)


@pytest.mark.parametrize('name', sorted(_hf_models()))
def test_imported_logits_equal_hf(name, hf_dirs, imported, devices):
  """Each import computes transformers' logits; its fields are the layout's (routing,
  dense layers, shared expert, the load-balance loss's weight, and no z-loss, which
  transformers lacks, written down whatever zoo's default)."""
  del devices
  workdir, setup = imported[name]
  np.testing.assert_allclose(_logits(setup, workdir, X), _hf_logits(hf_dirs[name][1], X), **LOGITS)
  m = setup.model
  want = {'mixtral': (True, (), 0), 'qwen2_moe': (False, (1,), 40),
          'qwen2_moe_norm': (True, (0, 2), 40), 'qwen3_moe': (True, (0,), 0),
          'qwen3_moe_unnormed': (False, (), 0)}[name]
  assert (m.norm_topk_prob, tuple(m.dense_layers), m.shared_expert_dim) == want
  coef = 0.02 if name == 'mixtral' else 0.005
  assert (m.num_experts, m.experts_per_token, m.router_aux_coef) == (4, 2, coef)
  with open(os.path.join(workdir, 'config.json'), encoding='utf-8') as f:
    assert json.load(f)['model']['router_z_coef'] == 0.0


@pytest.mark.parametrize('name', ['mixtral', 'qwen2_moe'])
def test_imported_experts_split_over_an_expert_axis_compute_hf_logits(name, hf_dirs, imported,
                                                                      devices):
  """Restored onto a mesh with an expert axis of 4 (each device one expert; tokens moving
  by all-to-all), FSDP over 2: the same logits."""
  workdir, placed = imported[name]
  axes = ('batch', 'expert', 'model')
  mesh = mesh_lib.make_mesh((2, 4, 1), axes, devices, batch_axes=('batch', 'expert'))
  rules = sharding.for_mesh(sharding.expert_rules(sharding.fsdp_rules()), axes)
  config = placed.config.copy_and_resolve_references()
  config.mesh.axes, config.mesh.shape = axes, (2, 4, 1)
  setup = setup_lib.build(config, placed.dataset, mesh=mesh, rules=rules)
  assert setup.state_shardings.params['block_0']['moe']['wi_up'].spec[0] == 'expert'
  np.testing.assert_allclose(_logits(setup, workdir, np.tile(X, (2, 1))),
                             np.tile(_hf_logits(hf_dirs[name][1], X), (2, 1, 1)), **LOGITS)


@pytest.mark.parametrize('name', ['mixtral', 'qwen2_moe', 'qwen3_moe'])
def test_export_loads_in_transformers_and_round_trips_bit_for_bit(name, hf_dirs, imported,
                                                                  tmp_path):
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  workdir, _ = imported[name]
  out = tmp_path / 'exported'
  assert transfer.export_model(workdir, str(out)) == name
  with safe_open(os.path.join(hf_dirs[name][0], 'model.safetensors'), 'np') as a, \
      safe_open(str(out / 'model.safetensors'), 'np') as b:
    assert set(a.keys()) == set(b.keys())
    for key in a.keys():
      np.testing.assert_array_equal(a.get_tensor(key), b.get_tensor(key), err_msg=key)
  with open(os.path.join(hf_dirs[name][0], 'config.json'), encoding='utf-8') as a, \
      open(out / 'config.json', encoding='utf-8') as b:
    assert json.load(a)['router_aux_loss_coef'] == json.load(b)['router_aux_loss_coef']
  reloaded = _hf_models()[name][0].from_pretrained(str(out)).eval()
  np.testing.assert_array_equal(_hf_logits(reloaded, X), _hf_logits(hf_dirs[name][1], X))


def test_experts_of_mlp_dim_units_export_their_width(hf_dirs, imported, tmp_path):
  """A zoo model whose experts take mlp_dim (expert_mlp_dim 0, the default) exports the
  experts' width into config.json: transformers loads it and computes the same logits."""
  workdir = str(tmp_path / 'run')
  shutil.copytree(imported['mixtral'][0], workdir)
  with open(os.path.join(workdir, 'config.json'), encoding='utf-8') as f:
    config = json.load(f)
  assert config['model']['mlp_dim'] == config['model']['expert_mlp_dim'] == 32
  config['model']['expert_mlp_dim'] = 0
  with open(os.path.join(workdir, 'config.json'), 'w', encoding='utf-8') as f:
    json.dump(config, f)
  transfer.export_model(workdir, str(tmp_path / 'exported'))
  reloaded = transformers.MixtralForCausalLM.from_pretrained(str(tmp_path / 'exported')).eval()
  assert reloaded.config.intermediate_size == 32
  np.testing.assert_array_equal(_hf_logits(reloaded, X), _hf_logits(hf_dirs['mixtral'][1], X))


def test_a_qwen2_moe_without_qkv_biases_is_refused_by_name(hf_dirs, tmp_path, devices):
  """transformers 5's Qwen2-MoE may turn its q/k/v biases off (qkv_bias), which zoo's
  Qwen2 attention always has: the import names the switch and writes nothing."""
  del devices
  path = tmp_path / 'hf'
  shutil.copytree(hf_dirs['qwen2_moe'][0], path)
  config = json.loads((path / 'config.json').read_text())
  (path / 'config.json').write_text(json.dumps({**config, 'qkv_bias': False}))
  with pytest.raises(ConfigError, match=r'this qwen2_moe model uses qkv_bias=False'):
    transfer.import_model(str(path), str(tmp_path / 'run'))
  assert not (tmp_path / 'run').exists()


def test_a_device_reads_only_the_experts_it_holds(hf_dirs, tmp_path, monkeypatch, devices):
  """Importing onto an expert axis of 4: each expert tensor of a layer is read for the
  devices that hold that expert, never the stack for every device (no [E, D, F] copy)."""
  del devices
  reads, original = [], transfer._read  # pylint: disable=protected-access
  monkeypatch.setattr(transfer, '_read', lambda f, n: reads.append(n) or original(f, n))
  captured = {}
  real_placed = setup_lib.placed

  def placed(config, dataset, mesh_shape, **kwargs):  # The import's run on an expert axis.
    config.mesh.axes, config.logical_axis_rules = ('batch', 'expert', 'model'), \
        sharding.expert_rules(sharding.standard_rules())
    captured['setup'] = real_placed(config, dataset, '1,4,2', **kwargs)
    return captured['setup']
  monkeypatch.setattr(setup_lib, 'placed', placed)
  transfer.import_model(hf_dirs['mixtral'][0], str(tmp_path / 'w'))
  assert captured['setup'].state_shardings.params['block_0']['moe']['wi_up'].spec[0] == 'expert'
  name = 'model.layers.0.block_sparse_moe.experts.{}.w1.weight'
  # Expert e lives on the 2 devices (model axis) at expert position e: read once for each.
  assert [reads.count(name.format(e)) for e in range(4)] == [2, 2, 2, 2]


@pytest.mark.parametrize('lora', [False, True])
def test_fine_tuning_an_imported_moe_learns_and_exports(lora, hf_dirs, imported, ft_data,
                                                       tmp_path, devices):
  """finetune_lm:smoke on the imported Qwen3-MoE (routed experts and a dense layer) learns;
  fully, its export loads in transformers with the trained logits; with LoRA (attention
  projections: routed experts take none) only the adapters train and the PEFT export on
  the original model computes zoo's logits."""
  from zoo.run import config as cfg, train  # pylint: disable=import-outside-toplevel
  del devices
  workdir, _ = imported['qwen3_moe']
  c = cfg.load_experiment(experiment('finetune_lm'), f'{workdir},smoke' + (',lora' if lora else ''))
  c.data.path, c.mesh.shape, c.train.log_every_steps = ft_data, (4, 2), 1
  run = str(tmp_path / 'run')
  train.train_and_evaluate(c, run)
  losses = [r['train/loss'] for r in read_metrics(run) if 'train/loss' in r]
  assert losses[-1] < 0.8 * losses[0], losses
  rows = [r for r in read_metrics(run) if 'train/moe/balance_loss' in r]
  assert rows and rows[-1]['train/moe/dropped'] == 0.0
  out = tmp_path / 'exported'
  transfer.export_model(run, str(out), peft=lora)
  setup = setup_lib.placed(c, data_lib.load(c.data, c.seed), "4,2", doing="checking")
  want = _logits(setup, run, X)
  if lora:
    assert set(c.model.lora.targets) == {'query', 'key', 'value', 'out'}
    peft = pytest.importorskip('peft')
    base = transformers.Qwen3MoeForCausalLM.from_pretrained(hf_dirs['qwen3_moe'][0])
    model = peft.PeftModel.from_pretrained(base, str(out)).eval()
  else:
    model = transformers.Qwen3MoeForCausalLM.from_pretrained(str(out)).eval()
  np.testing.assert_allclose(_hf_logits(model, X), want, atol=2e-5, rtol=2e-5)
