"""Tests run on 8 emulated CPU devices, set up before JAX initialises."""
import atexit
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile

# XLA:CPU's backend (LLVM) at optimisation level 0: compiling was most of the suite's time
# and its programs are tiny (a LoRA smoke run: 8.6 s of backend compile instead of 17.2 s,
# the same losses). And its classic elemental emitters instead of the fusion emitters
# (char_lm's smoke train step: 0.5 s of compile instead of 1.0, its eval step 0.16 instead
# of 0.23). And its LLVM module compiled whole, not split into parts for a thread pool:
# two pytest workers already keep both cores busy, so the parts only cost (char_lm, moe_lm,
# seq_sort smoke runs: 8-14% less CPU). The numbers the tests compare are computed under
# the same flags.
COMPILER_FLAGS = ('--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false '
                  '--xla_cpu_parallel_codegen_split_count=1')
os.environ['XLA_FLAGS'] = f'--xla_force_host_platform_device_count=8 {COMPILER_FLAGS}'
os.environ['JAX_PLATFORMS'] = 'cpu'
# One XLA compilation cache for this session's processes (the tests and every CLI or
# multi-process job they start, which inherit the environment): the same small programs
# compile once instead of in each subprocess, which takes minutes off the suite. Fresh and
# empty each session, so no test depends on an earlier run.
# pytest-xdist's workers inherit the session's cache from the process that starts them.
_CACHE = os.environ.get('ZOO_TEST_JAX_CACHE')
if not _CACHE:
  _CACHE = os.environ['ZOO_TEST_JAX_CACHE'] = tempfile.mkdtemp(prefix='zoo-test-jax-cache-')
  atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
os.environ['JAX_COMPILATION_CACHE_DIR'] = _CACHE
os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'
os.environ['JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES'] = '0'

import pytest  # pylint: disable=wrong-import-position

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_collection_finish(session):
  """The test modules and what they import live as long as the worker: frozen, as the
  commands' shell freezes theirs (zoo.shell.run), Python's full collections skip them."""
  del session
  gc.freeze()


def experiment(name):
  return os.path.join(REPO, 'experiments', f'{name}.py')


def load_config(name, arg='smoke', **overrides):
  """An experiment's config with dotted overrides, e.g. {'train.steps': 5}."""
  from zoo.run.config import load_experiment  # pylint: disable=import-outside-toplevel
  config = load_experiment(experiment(name), arg)
  for key, value in overrides.items():
    *groups, leaf = key.split('.')
    node = config
    for g in groups:
      node = node[g]
    node[leaf] = value
  return config


def tiny_gpt2(directory):
  """Saves a tiny random GPT-2 (transformers) with zoo's bytes tokenizer into `directory`."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  from zoo.data import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
  torch.manual_seed(0)
  transformers.GPT2LMHeadModel(transformers.GPT2Config(
      vocab_size=257, n_positions=32, n_embd=16, n_layer=1, n_head=2, bos_token_id=256,
      eos_token_id=256)).save_pretrained(directory)
  tokenizer_lib.bytes_tokenizer().save(os.path.join(directory, 'tokenizer.json'))
  return str(directory)


def numpy_hf(directory, config):
  """A random Hugging Face model of `config` (its config.json) laid out as save_pretrained
  writes it, with zoo's bytes tokenizer, from numpy as transformers initialises one (norm
  weights 1, biases 0, the rest N(0, 0.02)): for tests that need a model to import, tune or
  sample but not transformers' numbers, without torch's start-up (~5 CPU-seconds a module)."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  from zoo.data import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
  from zoo.hf import layouts  # pylint: disable=import-outside-toplevel
  _, arch = layouts.architecture(config)
  rng = np.random.default_rng(0)
  def initial(name, shape):
    if name.endswith('.bias'):
      return np.zeros(shape, np.float32)
    if name.endswith('norm.weight') or '.ln_' in name or name.startswith('transformer.ln_'):
      return np.ones(shape, np.float32)
    return (0.02 * rng.standard_normal(shape)).astype(np.float32)
  os.makedirs(directory)
  save_file({t.name: initial(t.name, t.shape) for t in arch.tensors(arch.from_hf(config))},
            os.path.join(directory, 'model.safetensors'), metadata={'format': 'pt'})
  with open(os.path.join(directory, 'config.json'), 'w', encoding='utf-8') as f:
    json.dump(config, f, indent=2)
  tokenizer_lib.bytes_tokenizer().save(os.path.join(directory, 'tokenizer.json'))
  return str(directory)


# conftest.tiny_gpt2's model: the config.json transformers 5 writes for it.
GPT2 = {'activation_function': 'gelu_new', 'add_cross_attention': False,
        'architectures': ['GPT2LMHeadModel'], 'attn_pdrop': 0.1, 'bos_token_id': 256,
        'dtype': 'float32', 'embd_pdrop': 0.1, 'eos_token_id': 256, 'initializer_range': 0.02,
        'layer_norm_epsilon': 1e-05, 'model_type': 'gpt2', 'n_embd': 16, 'n_head': 2,
        'n_inner': None, 'n_layer': 1, 'n_positions': 32, 'pad_token_id': None,
        'reorder_and_upcast_attn': False, 'resid_pdrop': 0.1,
        'scale_attn_by_inverse_layer_idx': False, 'scale_attn_weights': True,
        'summary_activation': None, 'summary_first_dropout': 0.1, 'summary_proj_to_labels': True,
        'summary_type': 'cls_index', 'summary_use_proj': True, 'tie_word_embeddings': True,
        'use_cache': True, 'vocab_size': 257}


def llama(hidden_size, intermediate_size, num_hidden_layers, num_attention_heads=4,
          num_key_value_heads=2, max_position_embeddings=64):
  """The config.json transformers 5 writes for LlamaConfig(vocab_size=257, these sizes)."""
  return {'architectures': ['LlamaForCausalLM'], 'attention_bias': False,
          'attention_dropout': 0.0, 'bos_token_id': 1, 'dtype': 'float32', 'eos_token_id': 2,
          'head_dim': hidden_size // num_attention_heads, 'hidden_act': 'silu',
          'hidden_size': hidden_size, 'initializer_range': 0.02,
          'intermediate_size': intermediate_size, 'max_position_embeddings': max_position_embeddings,
          'mlp_bias': False, 'model_type': 'llama', 'num_attention_heads': num_attention_heads,
          'num_hidden_layers': num_hidden_layers, 'num_key_value_heads': num_key_value_heads,
          'pad_token_id': None, 'pretraining_tp': 1, 'rms_norm_eps': 1e-06,
          'rope_parameters': {'rope_theta': 10000.0, 'rope_type': 'default'},
          'tie_word_embeddings': False, 'use_cache': True, 'vocab_size': 257}


def saved_hf_models(models, root):
  """{name: (directory, torch module)}: each (class, config) of `models` built with torch's
  seed 0 and saved by save_pretrained under `root`, with zoo's bytes tokenizer for text."""
  import torch  # pylint: disable=import-outside-toplevel
  from zoo.data import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
  out = {}
  for name, (cls, config) in models.items():
    torch.manual_seed(0)
    model = cls(config).eval()
    model.save_pretrained(root / name)
    if getattr(config, 'vocab_size', None):
      tokenizer_lib.bytes_tokenizer().save(str(root / name / 'tokenizer.json'))
    out[name] = (str(root / name), model)
  return out


def prepared_text(tokenizer_dir, root, line='line {i}: the cat sat on the mat. ' * 4,
                  lines=40, name='ft_data'):
  """A small token dataset `root/name` that zoo.prepare makes, in the tokenizer of
  `tokenizer_dir` (an imported workdir), from `lines` documents `line.format(i=i)`: what
  fine-tuning tests train on."""
  docs = root / 'docs.jsonl'
  docs.write_text(''.join(json.dumps({'text': line.format(i=i)}) + '\n' for i in range(lines)))
  result = subprocess.run([sys.executable, '-m', 'zoo.prepare', 'text', f'--input={docs}',
                           f'--output={root / name}', '--val_fraction=0.2',
                           f'--tokenizer={tokenizer_dir}/tokenizer.json'], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False)
  assert result.returncode == 0, result.stderr[-2000:]
  return str(root / name)


# The tiny random Qwen2 (q/k/v biases, grouped-query attention) that DPO's and GRPO's
# checks against TRL import: one per test process.
QWEN = dict(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
            bos_token_id=256, eos_token_id=256, tie_word_embeddings=False)


@pytest.fixture(scope='session')
def qwen_import(tmp_path_factory):
  """QWEN saved by transformers (with the bytes tokenizer) and imported into zoo:
  {'hf': its directory, 'workdir': the import}."""
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  from zoo.data import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
  from zoo.hf import transfer  # pylint: disable=import-outside-toplevel
  root = tmp_path_factory.mktemp('qwen')
  torch.manual_seed(0)
  transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**QWEN)).save_pretrained(root / 'hf')
  tokenizer_lib.bytes_tokenizer().save(str(root / 'hf' / 'tokenizer.json'))
  transfer.import_model(str(root / 'hf'), str(root / 'imported'))
  return {'hf': str(root / 'hf'), 'workdir': str(root / 'imported')}


def imported_state(trainer, workdir):
  """`trainer`'s fresh state with the parameters of `workdir` (an imported model's run)."""
  from zoo.store import checkpoint  # pylint: disable=import-outside-toplevel
  with trainer.scope():
    params, _, _ = checkpoint.restore_params(workdir, trainer.setup.abstract_state().params)
  return trainer.initial.replace(params=params)


def read_metrics(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
    return [json.loads(line) for line in f]


def cli_env():
  """The environment of a command a test starts: the tests' compiler flags without their
  device count (the command sets its own with --cpu_devices, or none)."""
  return {**os.environ, 'XLA_FLAGS': COMPILER_FLAGS}


def run_cli(*args, devices=8, timeout=300):
  """Runs `python -m zoo.main ARGS` on `devices` emulated CPU devices."""
  env = cli_env()
  cmd = [sys.executable, '-m', 'zoo.main', f'--cpu_devices={devices}', *args]
  return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                        check=False)


def stop_at(monkeypatch, stop_step):
  """Makes a run behave as if SIGTERM arrived during step `stop_step` (it saves and exits)."""
  from zoo.store import checkpoint  # pylint: disable=import-outside-toplevel
  original = checkpoint.StopRequest.__call__
  monkeypatch.setattr(checkpoint.StopRequest, '__call__',
                      lambda self, step: step == stop_step or original(self, step))


def count_calls(monkeypatch, module, name):
  """Replaces module.name by a wrapper that counts its calls; returns the list of calls."""
  original, calls = getattr(module, name), []
  def counted(*args, **kwargs):
    calls.append(1)
    return original(*args, **kwargs)
  monkeypatch.setattr(module, name, counted)
  return calls


@pytest.fixture(scope='session')
def devices():
  import jax  # pylint: disable=import-outside-toplevel
  assert jax.device_count() == 8, 'tests expect 8 emulated CPU devices'
  return jax.devices()


_TRAINERS = {}


def trainer(experiment, **overrides):
  """A Trainer for the experiment's smoke config with `overrides`, built once per session."""
  key = (experiment, repr(sorted(overrides.items())))
  if key not in _TRAINERS:
    _TRAINERS[key] = Trainer(load_config(experiment, **overrides))
  return _TRAINERS[key]


class Trainer:
  """An experiment's Setup, state and jitted steps on its mesh, in process, for numerics tests."""

  def __init__(self, config, devices=None):
    """On `devices` (default: all of them), as a process that has only those would run."""
    from zoo.run import config as cfg, setup  # pylint: disable=import-outside-toplevel
    from zoo import data
    from zoo.data import feed  # pylint: disable=import-outside-toplevel
    import jax  # pylint: disable=import-outside-toplevel
    # No test runs a config that a user could not.
    cfg.validate(config, len(devices) if devices else jax.device_count())
    self.config, self.jax = config, jax
    self.dataset = data.load(config.data, config.seed)
    # What train.train_and_evaluate builds.
    self.setup = setup.build(config, self.dataset, devices=devices)
    self.mesh, self.rules, self.model = self.setup.mesh, self.setup.rules, self.setup.model
    self.shardings = self.setup.state_shardings
    self.train_batch = feed.TrainBatches(self.dataset, self.setup.placement,
                                         config.train.batch_size, arrange=self.setup.arrange)
    with self.scope():
      self.initial = self.setup.create_state()
      self.state = self.initial
      self.train_step = self.setup.jit_train_step()
      self.eval_step = self.setup.jit_eval_step()

  def scope(self):
    return self.setup.scope()

  def batch(self, step):
    return self.train_batch(step)

  def run(self, steps):
    """Trains `steps` steps from the initial state into `self.state`; returns the losses
    (and keeps every step's metrics, as floats, in `self.metrics`)."""
    self.metrics = []
    with self.scope():
      self.state = self.jax.tree.map(lambda x: x.copy(), self.initial)  # The step donates it.
      for step in range(steps):
        self.state, metrics = self.train_step(self.state, self.batch(step))
        self.metrics.append({k: float(v) for k, v in metrics.items()})
    return [m['train/loss'] for m in self.metrics]


def pytest_unconfigure(config):  # pylint: disable=unused-argument
  """A session whose tests passed but whose process does not exit (a library's exit hook
  waiting for good) fails within a minute, printing every thread's stack, instead of hanging
  CI until its time runs out."""
  import faulthandler  # pylint: disable=import-outside-toplevel
  faulthandler.dump_traceback_later(60, exit=True)
