"""LoRA on an imported model (experiments/finetune_lm.py:WORKDIR,smoke,lora): only the
adapters train (the base weights bit-identical, no optimizer state and no gradient
all-reduce for them), resume is exact on another mesh, the plan shows the optimizer bytes
against a full fine-tune, and both exports (merged weights; a PEFT adapter on the original
model) give zoo's logits in transformers and peft within 1e-4."""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import REPO, cli_env, experiment, read_metrics, stop_at
from zoo.data import tokenizer as tokenizer_lib
from zoo.data import writer
from zoo.errors import ConfigError
from zoo.hf import transfer
from zoo.models import lora
from zoo.parallel import hlo
from zoo.run import config as cfg
from zoo.run import plan, train
from zoo.run import setup as setup_lib
from zoo.store import checkpoint

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

VOCAB = 257


@pytest.fixture(scope='module')
def imported(tmp_path_factory):
  """A tiny random Llama (GQA) imported into zoo, and a byte-token dataset to tune it on."""
  root = tmp_path_factory.mktemp('lora')
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
      bos_token_id=256, eos_token_id=256)).eval()
  model.save_pretrained(root / 'hf')
  tokenizer_lib.bytes_tokenizer().save(str(root / 'hf' / 'tokenizer.json'))
  transfer.import_model(str(root / 'hf'), str(root / 'imported'))
  # What `python -m zoo.prepare text --tokenizer=IMPORTED/tokenizer.json` makes (in this
  # process: the command line's own tests are prepare_test's).
  docs = root / 'docs.jsonl'
  docs.write_text(''.join(json.dumps({'text': ('{i}: the lazy dog naps in the sun. ' * 3).format(
      i=i)}) + '\n' for i in range(60)))
  data = str(root / 'data')
  writer.run('text', writer.Options(inputs=(str(docs),), output=data, val_fraction=0.2,
                                    tokenizer=str(root / 'imported' / 'tokenizer.json')))
  return {'hf': str(root / 'hf'), 'model': model, 'workdir': str(root / 'imported'),
          'data': data}


def _config(imported, lora_rank=True, **overrides):
  variant = ',smoke,lora' if lora_rank else ',smoke'
  c = cfg.load_experiment(experiment('finetune_lm'), imported['workdir'] + variant)
  c.data.path, c.mesh.shape = imported['data'], (4, 2)
  c.train.log_every_steps, c.checkpoint.async_save = 1, False
  for key, value in overrides.items():
    group, name = key.split('.')
    c[group][name] = value
  return c


def _params(workdir, setup):
  with setup.scope():
    params, _, _ = checkpoint.restore_params(workdir, setup.abstract_state().params)
  return jax.tree_util.tree_flatten_with_path(jax.device_get(params))[0]


@pytest.fixture(scope='module')
def tuned(imported, tmp_path_factory):
  """The smoke LoRA run, trained straight through on mesh (4, 2)."""
  workdir = str(tmp_path_factory.mktemp('tuned'))
  train.train_and_evaluate(_config(imported), workdir)
  return workdir


def test_only_the_adapters_train_and_the_loss_falls(imported, tuned, devices):
  del devices
  config = _config(imported)
  setup = setup_lib.build(config, _dataset(config))
  base = {tuple(str(getattr(k, 'key', k)) for k in path): x
          for path, x in _params(imported['workdir'], setup_lib.build(
              _config(imported, lora_rank=False), _dataset(config)))}
  adapters = 0
  for path, x in _params(tuned, setup):
    names = tuple(str(getattr(k, 'key', k)) for k in path)
    if lora.is_adapter(names):
      adapters += 1
      if names[-1].endswith('_b'):  # Zero at the start; trained away from it.
        assert np.abs(x).max() > 0, names
    else:
      np.testing.assert_array_equal(x, base[names], err_msg=str(names))  # Frozen, bit for bit.
  assert adapters == 2 * 2 * 7  # 2 layers x 7 projections x (A, B).
  opt_leaves = jax.tree.leaves(setup.abstract_state().opt_state)
  adapter_sizes = sum(x.size for path, x in jax.tree_util.tree_flatten_with_path(
      setup.abstract_state().params)[0]
                      if lora.is_adapter(tuple(str(getattr(k, 'key', k)) for k in path)))
  assert sum(x.size for x in opt_leaves) <= 2 * adapter_sizes + 8  # Adam's two moments + counts.
  losses = [r['train/loss'] for r in read_metrics(tuned) if 'train/loss' in r]
  assert losses[-1] < 0.95 * losses[0], losses  # 5.57 -> 5.14 measured in 20 steps.


def _dataset(config):
  from zoo import data  # pylint: disable=import-outside-toplevel
  return data.load(config.data, config.seed)


def _all_reduce_bytes(config):
  setup = setup_lib.build(config, _dataset(config))
  with setup.scope():
    compiled = setup.jit_train_step().lower(setup.abstract_state(), setup.batch).compile()
  rows = hlo.collectives(compiled.as_text(), setup.mesh)
  assert any(r['kind'] == 'all-reduce' and 'model' in str(r['axes']) for r in rows)
  return sum(r['bytes'] for r in rows if r['kind'] == 'all-reduce' and r['axes'] == 'batch')


def test_frozen_weights_have_no_gradient_all_reduce(imported, devices):
  """Data-parallel over 4 shards: a full fine-tune all-reduces every weight's gradient over
  'batch'; LoRA only the adapters' (and the loss). The activations' all-reduces over
  'model' (Megatron's, forward and backward) are the same in both."""
  del devices
  full, adapted = (_all_reduce_bytes(_config(imported, lora_rank=r)) for r in (False, True))
  assert adapted < 0.25 * full, (adapted, full)


def test_a_stopped_lora_run_resumes_exactly_on_another_mesh(imported, tuned, tmp_path,
                                                           monkeypatch, devices):
  del devices
  workdir = str(tmp_path / 'resumed')
  stop_at(monkeypatch, 10)
  train.train_and_evaluate(_config(imported), workdir)
  monkeypatch.undo()
  train.train_and_evaluate(_config(imported, **{'mesh.shape': (8, 1)}), workdir)
  strip = lambda d: [{k: v for k, v in r.items() if not k.startswith('perf/')}
                     for r in read_metrics(d)]
  got, want = strip(workdir), strip(tuned)
  assert [r['step'] for r in got] == [r['step'] for r in want]
  for row, ref in zip(got, want):
    assert row == pytest.approx(ref, rel=2e-5), (row, ref)


def test_the_plan_shows_optimizer_bytes_against_a_full_fine_tune(imported, devices):
  del devices
  p = plan.make_plan(_config(imported))
  held = p['bytes_per_device']
  assert 0 < held['optimizer'] < 0.25 * held['optimizer_full_fine_tune'], held
  assert "  (a full fine-tune's)" in plan.format_plan(p)
  assert 'optimizer_full_fine_tune' not in plan.make_plan(
      _config(imported, lora_rank=False))['bytes_per_device']


def _zoo_logits(config, workdir, x):
  setup = setup_lib.build(config, _dataset(config))
  with setup.scope():
    params, _, _ = checkpoint.restore_params(workdir, setup.abstract_state().params)
    return np.asarray(jax.jit(lambda p: setup.model.apply({'params': p}, x))(params))[..., :VOCAB]


def test_merged_and_peft_exports_give_zoo_logits(imported, tuned, tmp_path, devices):
  del devices
  peft = pytest.importorskip('peft')
  x = np.random.default_rng(0).integers(0, VOCAB, size=(2, 12)).astype(np.int32)
  want = _zoo_logits(_config(imported), tuned, x)
  base_logits = _zoo_logits(_config(imported, lora_rank=False), imported['workdir'], x)
  assert np.abs(want - base_logits).max() > 1e-3  # The adapters change the model.
  merged = tmp_path / 'merged'
  assert transfer.export_model(tuned, str(merged)) == 'llama'
  model = transformers.LlamaForCausalLM.from_pretrained(str(merged)).eval()
  with torch.no_grad():
    np.testing.assert_allclose(model(torch.tensor(x, dtype=torch.long)).logits.numpy(), want,
                               atol=1e-4, rtol=1e-4)
  adapter = tmp_path / 'adapter'
  env = cli_env()
  result = subprocess.run([sys.executable, '-m', 'zoo.convert', 'export', f'--workdir={tuned}',
                           f'--hf_dir={adapter}', '--peft'], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=180, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  assert sorted(os.listdir(adapter)) == ['adapter_config.json', 'adapter_model.safetensors']
  with open(adapter / 'adapter_config.json', encoding='utf-8') as f:  # The imported original.
    assert json.load(f)['base_model_name_or_path'] == os.path.abspath(imported['hf'])
  base = transformers.LlamaForCausalLM.from_pretrained(imported['hf']).eval()
  tuned_model = peft.PeftModel.from_pretrained(base, str(adapter)).eval()
  with torch.no_grad():
    got = tuned_model(torch.tensor(x, dtype=torch.long)).logits.numpy()
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize('lora_fields,message', [
    ({'rank': -1}, r'config\.model\.lora\.rank: must be an integer in \[0, 65536\]'),
    ({'dropout': 1.5}, r'config\.model\.lora\.dropout: must be in \[0, 1\)'),
    ({'targets': ('query', 'wi')}, r"config\.model\.lora\.targets: must be a tuple of this "
                                    r"model's projections among query, key, value, out, wi_gate, "
                                    r'wi_up, wo'),
    ({'targets': ()}, r'config\.model\.lora\.targets: must be a tuple'),
])
def test_bad_lora_fields_are_one_line(imported, lora_fields, message, devices):
  config = _config(imported)
  config.model.lora.update(lora_fields)
  with pytest.raises(ConfigError, match=message):
    cfg.validate(config, len(devices))


def test_peft_export_of_a_run_without_adapters_is_one_line(imported, tmp_path):
  with pytest.raises(ConfigError, match=r'^--peft: the run has no LoRA adapters'):
    transfer.export_model(imported['workdir'], str(tmp_path / 'out'), peft=True)
  assert not (tmp_path / 'out').exists()
