"""Hugging Face weights in and out: tiny random GPT-2, Llama (grouped-query attention) and ViT
built by `transformers`, imported on several meshes (logits equal HF's), exported (loads in
transformers, every tensor bit-identical), greedy decoding equal to HF's `generate`, and
every bad input named."""
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import REPO, cli_env, prepared_text, saved_hf_models, stop_at
from zoo.data import tokenizer as tokenizer_lib
from zoo.errors import ConfigError
from zoo.hf import transfer
from zoo.parallel import mesh as mesh_lib
from zoo.parallel import sharding
from zoo.run import sampling
from zoo.run import setup as setup_lib
from zoo.store import checkpoint

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

VOCAB = 257  # zoo's bytes tokenizer: each model's tokenizer.json.
# zoo's float32 logits against transformers' (measured: at most 4.3e-6 on GPT-2's logits of
# up to 6, 2e-6 on the ViT's, 3e-7 on Llama's).
LOGITS = dict(atol=1e-5, rtol=1e-5)


def _hf_models():
  return {
      'gpt2': (transformers.GPT2LMHeadModel, transformers.GPT2Config(
          vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=8, bos_token_id=256,
          eos_token_id=256, initializer_range=0.2)),
      'llama': (transformers.LlamaForCausalLM, transformers.LlamaConfig(
          vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
          num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
          rms_norm_eps=1e-5, rope_theta=500.0, bos_token_id=256, eos_token_id=256)),
      # Weights 10x HF's default scale: logits ~5, not ~0.1, so that a wrong activation
      # (tanh GELU for exact GELU moves them by ~1e-3, ~5e-6 at the default) is no rounding.
      'vit': (transformers.ViTForImageClassification, transformers.ViTConfig(
          image_size=8, patch_size=2, num_channels=1, hidden_size=64, num_hidden_layers=2,
          num_attention_heads=8, intermediate_size=96, num_labels=10, initializer_range=0.2)),
  }


@pytest.fixture(scope='module')
def hf_dirs(tmp_path_factory):
  """Each tiny model saved with save_pretrained, and its torch module."""
  return saved_hf_models(_hf_models(), tmp_path_factory.mktemp('hf'))


@pytest.fixture(scope='module')
def imported(hf_dirs, tmp_path_factory):
  """Each model imported onto every device on 'model' (grouped keys and values replicated)."""
  root = tmp_path_factory.mktemp('imported')
  return {name: (str(root / name), transfer.import_model(path, str(root / name)))
          for name, (path, _) in hf_dirs.items()}


def _inputs(name):
  rng = np.random.default_rng(0)
  if name == 'vit':
    return rng.normal(size=(2, 8, 8, 1)).astype(np.float32)
  return rng.integers(0, VOCAB, size=(2, 12)).astype(np.int32)


def _hf_logits(model, name, x):
  with torch.no_grad():
    if name == 'vit':
      return model(pixel_values=torch.tensor(x.transpose(0, 3, 1, 2))).logits.numpy()
    return model(torch.tensor(x, dtype=torch.long)).logits.numpy()


def _zoo_logits(setup, workdir, x):
  with setup.scope():
    params, _, _ = checkpoint.restore_params(workdir, setup.abstract_state().params)
    logits = jax.jit(lambda p, x: setup.model.apply({'params': p}, x))(params, x)
  return np.asarray(logits)[..., :VOCAB] if x.dtype == np.int32 else np.asarray(logits)


@pytest.mark.parametrize('name', ['gpt2', 'llama', 'vit'])
@pytest.mark.parametrize('mesh_shape', [(4, 2), (1, 8), (1, 1)])
def test_imported_logits_equal_hf(name, mesh_shape, hf_dirs, imported, devices):
  """The checkpoint import wrote, restored onto another mesh, computes HF's logits."""
  workdir, placed = imported[name]
  count = mesh_shape[0] * mesh_shape[1]
  mesh = mesh_lib.make_mesh(mesh_shape, ('batch', 'model'), devices[:count])
  logical = placed.logical_state.params
  rules = sharding.fit_rules(logical, mesh, placed.config.logical_axis_rules)
  setup = setup_lib.build(placed.config, placed.dataset, mesh=mesh, rules=rules)
  x = _inputs(name)
  np.testing.assert_allclose(_zoo_logits(setup, workdir, x), _hf_logits(hf_dirs[name][1], name, x),
                             **LOGITS)
  if name == 'llama' and mesh_shape == (4, 2):  # Grouped keys and values split over 'model'.
    assert setup.state_shardings.params['block_0']['attn']['key'].spec[1] == 'model'


def test_import_on_one_device_through_the_cli(hf_dirs, tmp_path):
  env = cli_env()
  result = subprocess.run([sys.executable, '-m', 'zoo.convert', 'import', '--cpu_devices=1',
                           f'--hf_dir={hf_dirs["llama"][0]}', f'--workdir={tmp_path / "one"}'],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=180, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "onto mesh {'batch': 1, 'model': 1}" in result.stderr
  assert sorted(os.listdir(tmp_path / 'one')) == ['checkpoints', 'config.json', 'imported.json',
                                                  'tokenizer.json']


@pytest.mark.parametrize('how', ['sharded', 'bfloat16'])
def test_import_reads_sharded_and_bfloat16_checkpoints(how, hf_dirs, tmp_path, devices):
  """Llama saved in shards with model.safetensors.index.json, or in bfloat16: the import
  reads every shard, stores bfloat16 exactly as float32, and computes HF's logits."""
  del devices
  _, model = hf_dirs['llama']
  source = tmp_path / how
  if how == 'sharded':
    model.save_pretrained(source, max_shard_size='40KB')
    with open(source / transfer.INDEX, encoding='utf-8') as f:
      assert len(set(json.load(f)['weight_map'].values())) > 2
    assert not (source / transfer.WEIGHTS).exists()
  else:
    model = transformers.LlamaForCausalLM.from_pretrained(hf_dirs['llama'][0],
                                                          dtype=torch.bfloat16)
    model.save_pretrained(source)
    model = transformers.LlamaForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
  tokenizer_lib.bytes_tokenizer().save(str(source / 'tokenizer.json'))
  placed = transfer.import_model(str(source), str(tmp_path / 'run'))
  with placed.scope():
    params, _, _ = checkpoint.restore_params(str(tmp_path / 'run'),
                                             placed.abstract_state().params)
  assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype('float32')}
  if how == 'bfloat16':  # Stored as the bfloat16 values, exactly.
    embed = model.model.embed_tokens.weight.detach().numpy()
    assert len(np.unique(embed.view(np.uint32) & 0xFFFF)) == 1  # bfloat16's 16 bits.
    np.testing.assert_array_equal(np.asarray(params['embed'])[:VOCAB], embed)
  x = _inputs('llama')
  np.testing.assert_allclose(_zoo_logits(placed, str(tmp_path / 'run'), x),
                             _hf_logits(model, 'llama', x), **LOGITS)


def test_export_writes_shards_of_max_shard_gib(imported, hf_dirs, tmp_path):
  """--max_shard_gib through the command line: HF's index and shards, none larger than the
  limit unless one tensor is, which transformers loads with the original's logits."""
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  workdir, _ = imported['llama']
  out, limit = tmp_path / 'exported', 40 * 2**10
  env = cli_env()
  result = subprocess.run([sys.executable, '-m', 'zoo.convert', 'export', '--cpu_devices=1',
                           f'--workdir={workdir}', f'--hf_dir={out}',
                           f'--max_shard_gib={limit / 2**30}'], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=180, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  with open(out / transfer.INDEX, encoding='utf-8') as f:
    weight_map = json.load(f)['weight_map']
  files = sorted(set(weight_map.values()))
  assert len(files) > 2 and not (out / transfer.WEIGHTS).exists()
  with safe_open(os.path.join(hf_dirs['llama'][0], 'model.safetensors'), 'np') as original:
    assert set(weight_map) == set(original.keys())
    for file in files:
      with safe_open(str(out / file), 'np') as shard:
        sizes = [shard.get_tensor(k).nbytes for k in shard.keys()]
        assert sum(sizes) <= limit or len(sizes) == 1, (file, sizes)
        for key in shard.keys():
          assert weight_map[key] == file
          np.testing.assert_array_equal(shard.get_tensor(key), original.get_tensor(key))
  reloaded = transformers.LlamaForCausalLM.from_pretrained(str(out)).eval()
  x = _inputs('llama')
  np.testing.assert_array_equal(_hf_logits(reloaded, 'llama', x),
                                _hf_logits(hf_dirs['llama'][1], 'llama', x))


@pytest.mark.parametrize('name', ['gpt2', 'llama', 'vit'])
def test_export_loads_in_transformers_and_round_trips_bit_for_bit(name, hf_dirs, imported,
                                                                  tmp_path):
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  workdir, _ = imported[name]
  out = tmp_path / 'exported'
  transfer.export_model(workdir, str(out))
  with safe_open(os.path.join(hf_dirs[name][0], 'model.safetensors'), 'np') as a, \
      safe_open(str(out / 'model.safetensors'), 'np') as b:
    assert set(a.keys()) == set(b.keys())
    for key in a.keys():
      np.testing.assert_array_equal(a.get_tensor(key), b.get_tensor(key), err_msg=key)
  cls = _hf_models()[name][0]
  reloaded = cls.from_pretrained(str(out)).eval()
  x = _inputs(name)
  np.testing.assert_array_equal(_hf_logits(reloaded, name, x), _hf_logits(hf_dirs[name][1], name, x))


@pytest.mark.parametrize('name', ['gpt2', 'llama'])
def test_greedy_sampling_equals_hf_generate(name, hf_dirs, imported, devices):
  del devices
  workdir, _ = imported[name]
  samples = sampling.generate(workdir, ['Hello wor', 'abc'], 16, temperature=0.0)
  model = hf_dirs[name][1]
  for s in samples:
    ids = torch.tensor([s['prompt_ids']])
    with torch.no_grad():
      want = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert s['ids'] == want
  assert len(set(samples[0]['ids'])) > 3, samples[0]['ids']  # Not one repeated token.


def _broken(hf_dir, tmp_path, how):
  path = tmp_path / 'broken'
  shutil.copytree(hf_dir, path)
  config = json.loads((path / 'config.json').read_text())
  if how == 'no_config':
    os.remove(path / 'config.json')
  elif how == 'no_weights':
    os.remove(path / 'model.safetensors')
  elif how == 'bert':
    config['model_type'] = 'bert'
  elif how == 'rope_scaling':
    config['rope_scaling'] = {'rope_type': 'longrope', 'factor': 4.0}  # YaRN is imported.
  elif how == 'shapes':
    config['intermediate_size'] = 128
  elif how in ('missing', 'extra'):
    from safetensors.numpy import load_file, save_file  # pylint: disable=import-outside-toplevel
    tensors = load_file(str(path / 'model.safetensors'))
    if how == 'missing':
      del tensors['model.layers.1.mlp.up_proj.weight']
    else:
      tensors['model.layers.0.self_attn.q_norm.weight'] = np.ones(8, np.float32)
    save_file(tensors, str(path / 'model.safetensors'), metadata={'format': 'pt'})
  elif how == 'tokenizer':
    big = tokenizer_lib.bytes_tokenizer()
    big.add_tokens([f'<x{i}>' for i in range(10)])
    big.save(str(path / 'tokenizer.json'))
  elif how == 'no_tokenizer':
    os.remove(path / 'tokenizer.json')
  (path / 'config.json').write_text(json.dumps(config)) if how != 'no_config' else None
  return str(path)


@pytest.mark.parametrize('how,message', [
    ('no_config', r'--hf_dir: .* has no config\.json'),
    ('no_weights', r'--hf_dir: .* has no model\.safetensors or model\.safetensors\.index\.json'),
    ('bert', r"--hf_dir: model_type 'bert' is not supported; supported: gemma, gemma2, "
             r'gemma3_text, gpt2, llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe, vit'),
    ('rope_scaling', r"--hf_dir: this llama model uses rope_type='longrope', which zoo does not "
                     r'implement'),
    ('missing', r'--hf_dir: the weights do not fit config\.json: missing tensors: '
                r'model\.layers\.1\.mlp\.up_proj\.weight'),
    ('extra', r'unexpected tensors: model\.layers\.0\.self_attn\.q_norm\.weight'),
    ('shapes', r'shapes that disagree with config\.json: model\.layers\.0\.mlp\.down_proj\.weight '
               r'\[64, 96\] \(config: \[64, 128\]\)'),
    ('tokenizer', r'--hf_dir: .*tokenizer\.json has ids up to 266, but the embedding has 257 rows'),
    ('no_tokenizer', r'--hf_dir: .*tokenizer\.json is not a file; save the tokenizer'),
])
def test_bad_hf_dirs_are_named_and_nothing_is_written(how, message, hf_dirs, tmp_path, devices):
  del devices
  path = _broken(hf_dirs['llama'][0], tmp_path, how)
  with pytest.raises(ConfigError, match=message):
    transfer.import_model(path, str(tmp_path / 'run'))
  assert not (tmp_path / 'run').exists()


def test_export_refuses_a_model_without_a_hf_layout(tmp_path, devices):
  from conftest import load_config  # pylint: disable=import-outside-toplevel
  from zoo.run import train  # pylint: disable=import-outside-toplevel
  del devices
  workdir = str(tmp_path / 'char')
  # The run of sample_test's lm_workdir: its programs compile once in a session.
  train.train_and_evaluate(load_config('char_lm', **{'train.steps': 2, 'eval.max_batches': 1,
                                                     'checkpoint.async_save': False}), workdir)
  with pytest.raises(ConfigError, match=r'matches none of the layouts export writes \(gemma, '
                                        r'gemma2, gemma3_text, gpt2, llama, mistral, mixtral, '
                                        r'qwen2, qwen2_moe, qwen3, qwen3_moe, vit'):
    transfer.export_model(workdir, str(tmp_path / 'out'))
  assert not (tmp_path / 'out').exists()


def test_fine_tuning_an_import_lowers_the_loss_and_resumes_exactly(hf_dirs, imported, tmp_path,
                                                                  monkeypatch, devices):
  """experiments/finetune_lm.py:smoke on the imported GPT-2, on a token dataset made with its
  own tokenizer: it starts from the import's params, learns, and a stopped run resumes."""
  from conftest import experiment, read_metrics  # pylint: disable=import-outside-toplevel
  from zoo.run import config as cfg, train  # pylint: disable=import-outside-toplevel
  del devices
  workdir, _ = imported['gpt2']
  data = prepared_text(workdir, tmp_path)

  def config():
    c = cfg.load_experiment(experiment('finetune_lm'), f'{workdir},smoke')
    c.data.path, c.mesh.shape, c.train.log_every_steps = data, (4, 2), 1
    return c
  train.train_and_evaluate(config(), str(tmp_path / 'straight'))
  rows = [r['train/loss'] for r in read_metrics(str(tmp_path / 'straight')) if 'train/loss' in r]
  assert rows[-1] < 0.7 * rows[0], rows
  stop_at(monkeypatch, 12)
  train.train_and_evaluate(config(), str(tmp_path / 'resumed'))
  monkeypatch.undo()
  train.train_and_evaluate(config(), str(tmp_path / 'resumed'))
  strip = lambda d: [{k: v for k, v in r.items() if not k.startswith('perf/')}
                     for r in read_metrics(str(tmp_path / d))]
  assert strip('resumed') == strip('straight')


def test_a_zoo_trained_gpt2_layout_exports_to_transformers(tmp_path, devices):
  """bpe_lm:smoke,gpt2 trained by zoo (not imported), exported: transformers computes zoo's
  logits."""
  from conftest import load_config  # pylint: disable=import-outside-toplevel
  from zoo.run import train  # pylint: disable=import-outside-toplevel
  del devices
  docs = tmp_path / 'docs.jsonl'
  docs.write_text(''.join(json.dumps({'text': f'{i}: pack my box with five dozen jugs. ' * 3}) + '\n'
                          for i in range(40)))
  result = subprocess.run([sys.executable, '-m', 'zoo.prepare', 'text', f'--input={docs}',
                           f'--output={tmp_path / "data"}', '--val_fraction=0.2'], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False)
  assert result.returncode == 0, result.stderr[-2000:]
  workdir = str(tmp_path / 'run')
  config = load_config('bpe_lm', 'smoke,gpt2', **{'data.path': str(tmp_path / 'data'),
                                                   'train.steps': 10, 'mesh.shape': (4, 2),
                                                   'checkpoint.async_save': False})
  train.train_and_evaluate(config, workdir)
  transfer.export_model(workdir, str(tmp_path / 'hf'))
  model = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / 'hf')).eval()
  eos = tokenizer_lib.load(str(tmp_path / 'hf' / 'tokenizer.json')).token_to_id(
      '<|endoftext|>')  # The trained tokenizer's end token, not GPT-2's default 50256.
  assert eos is not None and (model.config.bos_token_id, model.config.eos_token_id) == (eos, eos)
  x = _inputs('gpt2')[:, :10]
  setup = setup_lib.build(config, shapes_of(config))
  np.testing.assert_allclose(_zoo_logits(setup, workdir, x), _hf_logits(model, 'gpt2', x),
                             **LOGITS)


def test_a_zoo_trained_llama_layout_under_scan_exports_to_transformers(tmp_path, devices):
  """bpe_lm:smoke,llama trained with its layers under nn.scan (parameters stacked): export
  writes them layer by layer, and transformers computes zoo's logits."""
  from conftest import load_config  # pylint: disable=import-outside-toplevel
  from zoo.run import train  # pylint: disable=import-outside-toplevel
  del devices
  docs = tmp_path / 'docs.jsonl'
  docs.write_text(''.join(json.dumps({'text': f'{i}: sphinx of black quartz, judge my vow. ' * 3})
                          + '\n' for i in range(40)))
  result = subprocess.run([sys.executable, '-m', 'zoo.prepare', 'text', f'--input={docs}',
                           f'--output={tmp_path / "data"}', '--val_fraction=0.2'], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False)
  assert result.returncode == 0, result.stderr[-2000:]
  workdir = str(tmp_path / 'run')
  config = load_config('bpe_lm', 'smoke,llama', **{
      'data.path': str(tmp_path / 'data'), 'train.steps': 4, 'mesh.shape': (4, 2),
      'checkpoint.async_save': False, 'model.scan_layers': True})
  train.train_and_evaluate(config, workdir)
  assert transfer.export_model(workdir, str(tmp_path / 'hf')) == 'llama'
  model = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / 'hf')).eval()
  x = _inputs('llama')[:, :10]
  setup = setup_lib.build(config, shapes_of(config))
  np.testing.assert_allclose(_zoo_logits(setup, workdir, x), _hf_logits(model, 'llama', x),
                             **LOGITS)


def shapes_of(config):
  from zoo import data  # pylint: disable=import-outside-toplevel
  return data.load(config.data, config.seed)


def test_import_and_export_never_hold_a_second_copy_of_the_weights(hf_dirs, tmp_path, monkeypatch,
                                                                  devices):
  """The host memory numpy holds (its tracemalloc domain; device buffers are JAX's) while
  import reads each Hugging Face tensor, and while export writes each shard (here 40 KB
  of a 0.36 MB Llama), is a fraction of the model: never a second whole copy. Export's
  one copy, the params orbax restores into numpy buffers that JAX's CPU arrays may then
  share (or copy: it varies from run to run), is not counted."""
  import tracemalloc  # pylint: disable=import-outside-toplevel
  import safetensors.numpy  # pylint: disable=import-outside-toplevel
  del devices
  path, _ = hf_dirs['llama']
  model_bytes = os.path.getsize(os.path.join(path, 'model.safetensors'))
  held = {'import': [], 'export': []}

  def numpy_bytes():
    snapshot = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.DomainFilter(True, np.lib.tracemalloc_domain),
         tracemalloc.Filter(False, '*/orbax/*')])  # The allocating line is orbax's.
    return sum(t.size for t in snapshot.traces)

  def watched(step, function):
    def wrapper(*args, **kwargs):
      out = function(*args, **kwargs)
      held[step].append(numpy_bytes())
      return out
    return wrapper
  monkeypatch.setattr(transfer, '_read', watched('import', transfer._read))  # pylint: disable=protected-access
  monkeypatch.setattr(safetensors.numpy, 'save_file',
                      watched('export', safetensors.numpy.save_file))
  tracemalloc.start()
  try:
    transfer.import_model(path, str(tmp_path / 'run'))
    transfer.export_model(str(tmp_path / 'run'), str(tmp_path / 'out'), max_shard_bytes=40 * 2**10)
  finally:
    tracemalloc.stop()
  assert len(held['import']) > 10 and len(held['export']) > 5, held
  assert max(held['import'] + held['export']) < 0.5 * model_bytes, (held, model_bytes)
