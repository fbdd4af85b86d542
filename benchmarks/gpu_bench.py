r"""GPU benchmark: zoo's training throughput against the PyTorch recipe a user would pick
instead, on one CUDA GPU, both measured in the same run. Not a test.

    python benchmarks/gpu_bench.py [--out=gpu_bench.json] [--rows=char_lm:100m,...] [--steps=100]
    python benchmarks/gpu_bench.py --smoke [--no_compile]   # Tiny shapes; any machine, CPU too.
    python benchmarks/gpu_bench.py --rows=llama-3.2-1b \
        --zoo_flags=--config.model.embedding_grad=sorted     # Another zoo setting, same peer.

Rows (same batch, sequence length and layer shapes on both sides; the issue-56 target of
zoo / peer in brackets):
  char_lm:100m   zoo's experiments/char_lm.py:100m (12 x 768, batch 32 x 1024, the char data's
                 vocabulary, 128 padded) against a nanoGPT-style GPT-2 of that shape [1.3].
  char_lm:1b     char_lm.py:1b (20 x 2048, batch 16 x 1024) against the nanoGPT-style GPT-2
                 [1.15].
  llama-3.2-1b   the Llama-3.2-1B shape (16 layers, d 2048, 32 query / 8 key-value heads, SwiGLU
                 8192, RMSNorm 1e-5, rotary theta 500,000, vocabulary 128,256 with an untied head,
                 batch 16 x 1024) as char_lm.py:1b with --config.model.* overrides, trained on
                 the standard library's .py files as a 32k byte-level BPE token dataset with packed
                 documents (`python -m zoo.prepare text ...`, made here, or reused from
                 --data_dir); the 128,256 vocabulary pads the data's 32,768. Peer:
                 transformers' LlamaForCausalLM [1.15].
  llama-3.2-1b:whole   the same with the loss on whole logits (model.loss_chunks=1): auto's
                 chunks against none [zoo / zoo: at least 0.95].
  llama-3.2-1b:stream  the same on `data.windows=stream` (windows cut across documents): the
                 ratio of the two is what packed documents cost [at least 0.95].
  char_lm:1b:fp8, llama-3.2-1b:fp8  the same with model.quantization=fp8 (issue 57): tokens/s
                 over the bf16 row's [1.15, 1.1] and the last logged training loss over its
                 [within 1%; run with --steps=300 for the issue's 300 steps].
  The Llama rows share one run of the peer, and the char_lm:1b rows another.
zoo runs as a user runs it, one subprocess a row: `python -m zoo.main --config=... --workdir=TMP
--config.train.steps=N ...`, evals and checkpoints only after the last step (zoo always does
both there; the workdir, 12 GB for a 1b checkpoint, is deleted after the row). Its tokens/s and
MFU are the medians of metrics.jsonl's `perf/tokens_per_s` and `perf/mfu` rows after the first
(which includes compilation). Its peak is the device allocator's `peak_bytes_in_use`, read by a
few-line bootstrap that runs zoo.main unchanged and asks JAX after train_and_evaluate returns.
The peer, one subprocess a row too (`--torch_row=NAME`), is random weights in float32,
bfloat16 autocast, torch.compile(model), AdamW(fused=True), TF32 matmuls and SDPA's flash
kernel (`sdpa_kernel(FLASH_ATTENTION)`; where it refuses the call, SDPA's own choice, said in
the notes), stepping on random token ids with the model's own shifted loss (1,023 targets a
row; tokens/s counts 1,024 as zoo's does). The GPT-2 peer is nanoGPT's design written in
this file (`nanogpt`: one fused query/key/value projection, scaled_dot_product_attention with
is_causal, GELU MLP), shaped as char_lm (no projection biases, an untied head); the Llama
peer is transformers' with attn_implementation='sdpa'.
Its tokens/s is the median of blocks of --log_every steps after the first block (compilation),
timed between torch.cuda.synchronize(); its peak torch.cuda.max_memory_allocated(). MFU on
both sides is zoo's model-FLOPs count (zoo.models.transformer_lm.train_flops: 6 N tokens +
12 layers len d tokens, N the matmul parameters with the head) over the data-sheet bf16 peak
(zoo.run.perf: 989 TFLOP/s for an H100 SXM). The peer keeps its activations (no remat).

Prints a table and writes --out (JSON: GPU, driver, jax/jaxlib/torch/transformers versions,
each row's commands, medians, ratio, target and whether it is met, and the zoo-to-zoo
ratios). Without a CUDA GPU (JAX's backend not gpu and
torch.cuda unavailable) it prints one line and exits 0; --smoke shrinks every shape (2 layers,
d 64, sequence 64, batch 4, 6 steps) and runs anywhere to check the code paths.
The GPU numbers in README.md and docs/performance.md come from one NVIDIA H100 80GB HBM3
(driver 580.159.04; Python 3.12, jax 0.11.2 with the CUDA 13 plugin, torch 2.11.0+cu130,
transformers 5.17); see their tables for the numbers.
"""
import argparse
import contextlib
import dataclasses
import importlib.metadata
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Shape:
  layers: int
  d_model: int
  heads: int
  kv_heads: int
  mlp_dim: int
  vocab: int      # Padded to zoo's multiple of 128 already.
  batch: int
  seq: int


@dataclasses.dataclass(frozen=True)
class Row:
  config: str     # The zoo experiment, experiments/<name>.py:<arg>.
  peer: str       # 'nanogpt' or 'llama'.
  shape: Shape
  windows: str = 'documents'  # Token datasets: packed documents, or 'stream' windows.
  flags: tuple = ()           # zoo.main flags of this row beside the shape's.
  target: float | None = None  # zoo / peer tokens per second wanted (issue 56).


LLAMA_1B = Shape(16, 2048, 32, 8, 8192, 128256, 16, 1024)
ROWS = {
    'char_lm:100m': Row('char_lm:100m', 'nanogpt', Shape(12, 768, 12, 12, 3072, 128, 32, 1024),
                        target=1.3),
    'char_lm:1b': Row('char_lm:1b', 'nanogpt', Shape(20, 2048, 16, 16, 8192, 128, 16, 1024),
                      target=1.15),
    'llama-3.2-1b': Row('char_lm:1b', 'llama', LLAMA_1B, target=1.15),
    # The same with the loss on whole logits: auto's chunks against none (target: within 5%).
    'llama-3.2-1b:whole': Row('char_lm:1b', 'llama', LLAMA_1B,
                              flags=('--config.model.loss_chunks=1',)),
    # The same on windows cut across documents: packed documents' cost (target: within 5%).
    'llama-3.2-1b:stream': Row('char_lm:1b', 'llama', LLAMA_1B, windows='stream'),
    # Low-precision matmuls (issue 57): fp8 against the bf16 rows above, same peer.
    'char_lm:1b:fp8': Row('char_lm:1b', 'nanogpt', Shape(20, 2048, 16, 16, 8192, 128, 16, 1024),
                          flags=('--config.model.quantization=fp8',)),
    'llama-3.2-1b:fp8': Row('char_lm:1b', 'llama', LLAMA_1B,
                            flags=('--config.model.quantization=fp8',)),
}
# Two zoo rows the issues set targets for: (name, numerator, denominator, the figure, the
# ratio's least, its most).
ZOO_RATIOS = (
    ('auto chunks / whole logits', 'llama-3.2-1b', 'llama-3.2-1b:whole', 'tokens_per_s', 0.95,
     None),
    ('packed documents / stream windows', 'llama-3.2-1b', 'llama-3.2-1b:stream', 'tokens_per_s',
     0.95, None),
    ('fp8 / bf16 tokens/s, char_lm:1b', 'char_lm:1b:fp8', 'char_lm:1b', 'tokens_per_s', 1.15,
     None),
    ('fp8 / bf16 tokens/s, Llama-3.2-1B', 'llama-3.2-1b:fp8', 'llama-3.2-1b', 'tokens_per_s', 1.1,
     None),
    ('fp8 / bf16 final loss, char_lm:1b', 'char_lm:1b:fp8', 'char_lm:1b', 'final_loss', 0.99,
     1.01),
    ('fp8 / bf16 final loss, Llama-3.2-1B', 'llama-3.2-1b:fp8', 'llama-3.2-1b', 'final_loss',
     0.99, 1.01))
LLAMA = dict(norm='rms', norm_epsilon=1e-5, mlp_activation='swiglu', positions='rotary',
             rope_theta=500000.0, tie_embeddings=False)
BPE_VOCAB, SMOKE_BPE_VOCAB = 32768, 512
SMOKE_FILES = ('argparse.py', 'ast.py', 'csv.py', 'dataclasses.py', 'difflib.py', 'enum.py')

# Runs zoo.main as `python -m zoo.main ARGS` does; afterwards writes the allocator's peak.
ZOO_BOOT = '''import json, runpy, sys
from zoo.run import train
peak_file, sys.argv = sys.argv[1], ['zoo.main'] + sys.argv[2:]
run = train.train_and_evaluate
def and_peak(*args, **kwargs):
  run(*args, **kwargs)
  import jax
  with open(peak_file, 'w') as f:
    json.dump((jax.local_devices()[0].memory_stats() or {}).get('peak_bytes_in_use'), f)
train.train_and_evaluate = and_peak
runpy.run_module('zoo.main', run_name='__main__', alter_sys=True)
'''


def shape_of(row: Row, smoke: bool) -> Shape:
  """The row's shape; --smoke's: 2 layers, d 64, 4 heads (2 key-value heads where grouped)."""
  s = row.shape
  if not smoke:
    return s
  return dataclasses.replace(s, layers=2, d_model=64, heads=4, mlp_dim=256, batch=4, seq=64,
                             kv_heads=4 if s.kv_heads == s.heads else 2, vocab=min(s.vocab, 1024))


def flops_per_token(s: Shape, swiglu: bool) -> int:
  """zoo's train_flops / tokens: 6 N + 12 L T d, N the matmul parameters and the head."""
  head = s.d_model // s.heads
  attention = s.d_model * head * (2 * s.heads + 2 * s.kv_heads)
  mlp = (3 if swiglu else 2) * s.d_model * s.mlp_dim
  matmul_params = s.layers * (attention + mlp) + s.d_model * s.vocab
  return 6 * matmul_params + 12 * s.layers * s.seq * s.d_model


def median_after_first(values: list) -> float | None:
  values = [v for v in values if v is not None]
  return statistics.median(values[1:]) if len(values) > 1 else None


def run_logged(argv: list, log: str) -> str | None:
  """Runs argv in the repository, which is on its PYTHONPATH, its output into `log`; None, or
  on failure the exit status and the log's last lines."""
  with open(log, 'w+', encoding='utf-8', errors='replace') as f:
    code = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, env=zoo_env(), cwd=ROOT,
                          check=False).returncode
    f.seek(0)
    return f'exit {code}: ' + ''.join(f.readlines()[-15:]) if code else None


def zoo_env() -> dict:
  path = os.environ.get('PYTHONPATH')
  return {**os.environ, 'PYTHONPATH': ROOT + (os.pathsep + path if path else '')}


def probe() -> None:
  """(--probe) What this machine has, as one JSON line; a subprocess, so that neither
  framework holds GPU memory in the parent."""
  os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'] = 'false'
  import jax  # pylint: disable=import-outside-toplevel
  try:
    import torch  # pylint: disable=import-outside-toplevel
  except ImportError:  # Said plainly by bench(): no peer to measure.
    torch = None
  cuda = bool(torch) and torch.cuda.is_available()
  print(json.dumps({
      'jax_backend': jax.default_backend(), 'jax_device': jax.devices()[0].device_kind,
      'torch': bool(torch), 'torch_cuda': cuda,
      'torch_device': torch.cuda.get_device_name() if cuda else 'cpu',
      'torch_cuda_version': torch.version.cuda if torch else None,
      'torch_cudnn': torch.backends.cudnn.version() if cuda else None}))


def machine() -> dict:
  """Devices, driver and versions, without starting a framework in this process."""
  done = subprocess.run([sys.executable, os.path.abspath(__file__), '--probe'],
                        capture_output=True, text=True, env=zoo_env(), check=False)
  if done.returncode:
    sys.exit(f'gpu_bench: probing the devices failed:\n{done.stderr[-2000:]}')
  info = json.loads(done.stdout.strip().splitlines()[-1])
  try:
    smi = subprocess.run(['nvidia-smi', '--query-gpu=name,driver_version', '--format=csv,noheader'],
                         capture_output=True, text=True, check=True).stdout
    info['gpu'], info['driver'] = [x.strip() for x in smi.splitlines()[0].split(',')]
  except (OSError, subprocess.CalledProcessError, ValueError, IndexError):
    info['gpu'], info['driver'] = info['torch_device'], None
  names = ('jax', 'jaxlib', 'flax', 'optax', 'torch', 'transformers')
  dists = {d.metadata['Name'] for d in importlib.metadata.distributions()}
  names += tuple(sorted(n for n in dists if n and n.replace('_', '-').startswith('jax-cuda')))
  info['versions'] = {n: importlib.metadata.version(n) for n in names if n in dists}
  info['python'] = sys.version.split()[0]
  return info


def prepare_tokens(data_dir: str, smoke: bool) -> int:
  """Writes the stdlib BPE token dataset with zoo's own command (unless data_dir has one);
  returns its vocabulary."""
  meta = os.path.join(data_dir, 'metadata.json')
  if not os.path.exists(meta):
    stdlib = sysconfig.get_paths()['stdlib']
    inputs = ([f'--input={os.path.join(stdlib, f)}' for f in SMOKE_FILES] if smoke else
              [f'--input={stdlib}/**/*.py', '--exclude=*/site-packages/*', '--skip_undecodable'])
    argv = [sys.executable, '-m', 'zoo.prepare', 'text', *inputs, f'--output={data_dir}',
            '--tokenizer=bpe', f'--vocab_size={SMOKE_BPE_VOCAB if smoke else BPE_VOCAB}',
            f'--val_fraction={0.2 if smoke else 0.02}']
    print('preparing', data_dir, flush=True)
    if error := run_logged(argv, data_dir.rstrip('/') + '.log'):
      sys.exit(f'gpu_bench: zoo.prepare failed, {error}')
  with open(meta, encoding='utf-8') as f:
    return json.load(f)['vocab_size']


def zoo_flags(row: Row, s: Shape, steps: int, log_every: int, data_dir: str) -> tuple[list, list]:
  """The row's zoo.main flags, and notes on Llama fields this config cannot take yet."""
  from zoo.run.config import load_experiment  # pylint: disable=import-outside-toplevel
  name, _, arg = row.config.partition(':')
  path = os.path.join('experiments', f'{name}.py')
  model = dict(num_layers=s.layers, d_model=s.d_model, num_heads=s.heads, mlp_dim=s.mlp_dim,
               max_len=s.seq)
  data, notes = {'seq_len': s.seq}, []
  if row.peer == 'llama':
    model.update(num_kv_heads=s.kv_heads, vocab_size=s.vocab, **LLAMA)
    data.update(name='tokens', path=data_dir, windows=row.windows)
    keys = load_experiment(os.path.join(ROOT, path), arg or None).model.keys()
    for key in [k for k in model if k not in keys]:
      notes.append(f'zoo: config.model.{key} is not settable in {row.config}: its default is used')
      del model[key]
  flags = [f'--config={path}:{arg}', f'--config.train.steps={steps}',
           f'--config.train.log_every_steps={log_every}', f'--config.train.batch_size={s.batch}',
           f'--config.eval.every_steps={steps + 1}', f'--config.checkpoint.every_steps={steps + 1}',
           f'--config.eval.batch_size={s.batch}', '--config.eval.max_batches=1']
  flags += [f'--config.model.{k}={v}' for k, v in model.items()]
  flags += [f'--config.data.{k}={v}' for k, v in data.items()]
  return flags + list(row.flags), notes


def run_zoo(row: Row, s: Shape, args, scratch: str, data_dir: str) -> dict:
  flags, notes = zoo_flags(row, s, args.steps, args.log_every, data_dir)
  flags += args.zoo_flags.split()  # Last: they override the row's (e.g. embedding_grad).
  workdir, peak_file = os.path.join(scratch, 'zoo_run'), os.path.join(scratch, 'zoo_peak.json')
  t0 = time.perf_counter()
  error = run_logged([sys.executable, '-c', ZOO_BOOT, peak_file, f'--workdir={workdir}', *flags],
                     os.path.join(scratch, 'zoo.log'))
  with open(os.path.join(scratch, 'zoo.log'), encoding='utf-8', errors='replace') as f:
    notes += [line.strip() for line in f if 'model.attention=' in line]  # Where XLA's ran.
  result = {'command': ' '.join(['python -m zoo.main', f'--workdir={workdir}', *flags]),
            'wall_s': round(time.perf_counter() - t0, 1), 'notes': notes}
  try:
    if error:
      return {**result, 'error': error}
    with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
      metrics = [r for r in map(json.loads, f) if 'perf/tokens_per_s' in r]
    result['tokens_per_s'] = median_after_first([r['perf/tokens_per_s'] for r in metrics])
    result['final_loss'] = metrics[-1].get('train/loss') if metrics else None
    result['mfu'] = median_after_first([r.get('perf/mfu') for r in metrics])
    with open(os.path.join(workdir, 'config.json'), encoding='utf-8') as f:
      result['model'] = json.load(f)['model']  # The resolved config.model: what ran.
    with open(peak_file, encoding='utf-8') as f:
      result['peak_bytes'] = json.load(f)
    return result
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
    if os.path.exists(peak_file):
      os.remove(peak_file)


def nanogpt(s: Shape):
  """A GPT-2 as nanoGPT writes it (its model.py's design, written here): pre-norm blocks of
  one fused query/key/value projection, scaled_dot_product_attention(is_causal=True) and a
  GELU MLP, learned positions; shaped as zoo's char_lm (no biases on the projections,
  LayerNorm with bias, an untied head). Returns a module whose forward(ids) is the mean
  next-token cross-entropy."""
  import torch  # pylint: disable=import-outside-toplevel
  from torch import nn  # pylint: disable=import-outside-toplevel
  functional = torch.nn.functional

  class Block(nn.Module):
    def __init__(self):
      super().__init__()
      self.ln_1, self.ln_2 = nn.LayerNorm(s.d_model), nn.LayerNorm(s.d_model)
      self.qkv = nn.Linear(s.d_model, 3 * s.d_model, bias=False)
      self.out = nn.Linear(s.d_model, s.d_model, bias=False)
      self.mlp = nn.Sequential(nn.Linear(s.d_model, s.mlp_dim, bias=False),
                               nn.GELU(approximate='tanh'),
                               nn.Linear(s.mlp_dim, s.d_model, bias=False))

    def forward(self, x):
      b, t, d = x.shape
      q, k, v = (y.view(b, t, s.heads, d // s.heads).transpose(1, 2)
                 for y in self.qkv(self.ln_1(x)).split(d, dim=2))
      y = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
      x = x + self.out(y.transpose(1, 2).reshape(b, t, d))
      return x + self.mlp(self.ln_2(x))

  class GPT(nn.Module):
    def __init__(self):
      super().__init__()
      self.wte, self.wpe = nn.Embedding(s.vocab, s.d_model), nn.Embedding(s.seq, s.d_model)
      self.blocks = nn.ModuleList(Block() for _ in range(s.layers))
      self.ln_f = nn.LayerNorm(s.d_model)
      self.head = nn.Linear(s.d_model, s.vocab, bias=False)
      for name, p in self.named_parameters():  # GPT-2's initialisation.
        if p.dim() > 1:
          nn.init.normal_(p, std=0.02 / (2 * s.layers) ** 0.5 if name.endswith(
              ('out.weight', 'mlp.2.weight')) else 0.02)

    def forward(self, ids):
      x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
      for block in self.blocks:
        x = block(x)
      logits = self.head(self.ln_f(x))
      return functional.cross_entropy(logits[:, :-1].reshape(-1, s.vocab).float(),
                                      ids[:, 1:].reshape(-1))
  return GPT()


def build_peer(peer: str, s: Shape):
  if peer == 'nanogpt':
    return nanogpt(s)
  import transformers  # pylint: disable=import-outside-toplevel
  transformers.logging.set_verbosity_error()
  common = dict(bos_token_id=None, eos_token_id=None, use_cache=False, attn_implementation='sdpa')
  return transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=s.vocab, hidden_size=s.d_model, intermediate_size=s.mlp_dim,
      num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
      max_position_embeddings=s.seq, rms_norm_eps=LLAMA['norm_epsilon'], tie_word_embeddings=False,
      rope_parameters={'rope_type': 'default', 'rope_theta': LLAMA['rope_theta']}, **common))


def torch_row(args) -> None:
  """(--torch_row=NAME) Trains the peer for --steps and writes its result to --result."""
  import torch  # pylint: disable=import-outside-toplevel
  row = ROWS[args.torch_row]
  s, cuda = shape_of(row, args.smoke), torch.cuda.is_available()
  device, notes = ('cuda' if cuda else 'cpu'), []
  torch.manual_seed(0)
  torch.set_float32_matmul_precision('high')  # TF32 for what autocast leaves in float32.
  with torch.device(device):
    model = build_peer(row.peer, s)
  try:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
  except (RuntimeError, TypeError) as e:  # (Older torch on CPU.)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    notes.append(f'torch: fused AdamW unavailable on {device} ({e}): the default AdamW')
  if args.no_compile:
    notes.append('torch: --no_compile: eager, not torch.compile')
  step_model = model if args.no_compile else torch.compile(model)
  ids = torch.randint(0, s.vocab, (s.batch, s.seq), device=device)
  sync = torch.cuda.synchronize if cuda else lambda: None
  forward = ((lambda: step_model(ids)) if row.peer == 'nanogpt' else
             (lambda: step_model(input_ids=ids, labels=ids).loss))
  # Flash attention: SDPA's flash kernel alone, where it takes the call (else SDPA's choice).
  attention = contextlib.nullcontext
  if cuda:
    from torch.nn.attention import SDPBackend, sdpa_kernel  # pylint: disable=import-outside-toplevel
    attention = lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)

  def step():
    with torch.autocast(device, dtype=torch.bfloat16), attention():
      loss = forward()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss

  try:
    step()  # Compiles; fails here if the flash kernel cannot take the model's call.
  except RuntimeError as e:  # SDPA's refusal says 'No available kernel'; anything else is not.
    if attention is contextlib.nullcontext or 'kernel' not in str(e).lower():
      raise
    notes.append(f'torch: SDPA\'s flash kernel refused ({str(e).splitlines()[0][:120]}): '
                 'SDPA chose its kernel')
    attention = contextlib.nullcontext
    torch._dynamo.reset()  # pylint: disable=protected-access
    step_model = model if args.no_compile else torch.compile(model)
    opt.zero_grad(set_to_none=True)

  rates = []
  for _ in range(args.steps // args.log_every):
    sync()
    t0 = time.perf_counter()
    for _ in range(args.log_every):
      loss = step()
    sync()
    rates.append(s.batch * s.seq * args.log_every / (time.perf_counter() - t0))
  with open(args.result, 'w', encoding='utf-8') as f:
    json.dump({'tokens_per_s': median_after_first(rates), 'block_tokens_per_s': rates,
               'loss': float(loss), 'device': device, 'autocast': f'bfloat16 on {device}',
               'peak_bytes': torch.cuda.max_memory_allocated() if cuda else None,
               'notes': notes}, f)


def run_torch(name: str, args, scratch: str) -> dict:
  result_file = os.path.join(scratch, 'torch.json')
  argv = [sys.executable, os.path.abspath(__file__), f'--torch_row={name}', f'--steps={args.steps}',
          f'--log_every={args.log_every}', f'--result={result_file}']
  argv += ['--smoke'] * args.smoke + ['--no_compile'] * args.no_compile
  t0 = time.perf_counter()
  if error := run_logged(argv, os.path.join(scratch, 'torch.log')):
    return {'error': error}
  with open(result_file, encoding='utf-8') as f:
    return {**json.load(f), 'wall_s': round(time.perf_counter() - t0, 1)}


def peak_flops(gpu: str, on_gpu: bool) -> float | None:
  """The data sheet's bf16 peak (zoo.run.perf); on CPU (smoke) this host's measured one."""
  import jax  # pylint: disable=import-outside-toplevel
  from zoo.run import perf  # pylint: disable=import-outside-toplevel
  if on_gpu:
    return perf.table_peak(gpu)
  jax.config.update('jax_platforms', 'cpu')  # (Not an installed TPU library's probing.)
  return perf.measured_cpu_peak()


def format_table(results: dict) -> str:
  num = lambda v, spec: '-' if v is None else format(v, spec)
  gib = lambda b: '-' if b is None else f'{b / 2**30:.1f} GiB'
  rows = [('shape', 'zoo tok/s', 'zoo MFU', 'zoo peak', 'torch tok/s', 'torch MFU', 'torch peak',
           'zoo/torch')]
  for name, r in results.items():
    z, t = r['zoo'], r['torch']
    rows.append((name, num(z.get('tokens_per_s'), ',.0f'), num(z.get('mfu'), '.1%'),
                 gib(z.get('peak_bytes')), num(t.get('tokens_per_s'), ',.0f'),
                 num(t.get('mfu'), '.1%'), gib(t.get('peak_bytes')), num(r['ratio'], '.2f')))
  widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
  return '\n'.join('  '.join(c.ljust(w) if i == 0 else c.rjust(w)
                             for i, (c, w) in enumerate(zip(row, widths))) for row in rows)


def bench(args) -> None:
  info = machine()
  if not info['torch']:
    sys.exit('gpu_bench: torch is not installed: the PyTorch peers cannot run (pip install torch '
             'transformers)')
  on_gpu = info['jax_backend'] == 'gpu' or info['torch_cuda']
  if not on_gpu and not args.smoke:
    print(f'gpu_bench: no CUDA GPU on this machine (jax backend: {info["jax_backend"]}, '
          'torch.cuda: unavailable): nothing measured')
    return
  if not args.smoke and not (info['jax_backend'] == 'gpu' and info['torch_cuda']):
    sys.exit(f'gpu_bench: only one framework sees the GPU (jax backend: {info["jax_backend"]}, '
             f'torch.cuda available: {info["torch_cuda"]}); install the other\'s CUDA build')
  names = args.rows.split(',') if args.rows else list(ROWS)
  if unknown := [n for n in names if n not in ROWS]:
    sys.exit(f'gpu_bench: --rows: unknown {unknown}; known: {", ".join(ROWS)}')
  peak = peak_flops(info['gpu'], on_gpu)
  results, notes = {}, []
  tmp_dir = os.path.abspath(args.tmp_dir) if args.tmp_dir else None  # (zoo runs in ROOT.)
  if tmp_dir:
    os.makedirs(tmp_dir, exist_ok=True)
  with tempfile.TemporaryDirectory(prefix='gpu_bench_', dir=tmp_dir) as scratch:
    data_dir = os.path.abspath(args.data_dir) if args.data_dir else os.path.join(scratch,
                                                                                 'stdlib_bpe')
    data_vocab, peers = None, {}
    for name in names:
      row = ROWS[name]
      s = shape_of(row, args.smoke)
      if row.peer == 'llama' and data_vocab is None:
        data_vocab = prepare_tokens(data_dir, args.smoke)
        notes.append(f'tokens dataset {data_dir}: vocabulary {data_vocab:,}, model {s.vocab:,}')
      print(f'{name}: zoo', flush=True)
      z = run_zoo(row, s, args, scratch, data_dir)
      # Said and saved before the peer runs: a run cut short keeps what it measured.
      print(f'{name}: zoo', z.get('tokens_per_s'), 'tokens/s, MFU', z.get('mfu'), *z['notes'],
            z.get('error', ''), flush=True)
      results[name] = {'shape': dataclasses.asdict(s), 'zoo': z, 'torch': {}, 'ratio': None}
      save(info, peak, args, results, notes)
      peer = (row.peer, s)  # The stream row's peer is the packed row's: run once.
      if peer not in peers:
        print(f'{name}: torch', flush=True)
        peers[peer] = run_torch(name, args, scratch)
      t = dict(peers[peer])
      if t.get('tokens_per_s') and peak:
        t['mfu'] = t['tokens_per_s'] * flops_per_token(s, row.peer == 'llama') / peak
      ratio = (z['tokens_per_s'] / t['tokens_per_s']
               if z.get('tokens_per_s') and t.get('tokens_per_s') else None)
      results[name] = {'shape': dataclasses.asdict(s), 'zoo': z, 'torch': t, 'ratio': ratio,
                       'target': row.target,
                       'met': None if ratio is None or row.target is None else ratio >= row.target}
      notes += [f'{name}: {n}' for n in z['notes'] + t.get('notes', [])]
      notes += [f'{name}: {side} failed: {r["error"]}' for side, r in (('zoo', z), ('torch', t))
                if 'error' in r]
  print(f'\n{info["gpu"]} (driver {info["driver"]}), {args.steps} steps, medians of blocks of '
        f'{args.log_every} after the first' + (' [--smoke: tiny shapes]' if args.smoke else ''))
  print(format_table(results))
  ratios = zoo_ratios(results)
  print('\n'.join([f'{r["name"]} (zoo): {r["ratio"]:.3f}, target {r["target"]}'
                   for r in ratios]
                  + [f'{n}: zoo / {ROWS[n].peer} {r["ratio"]:.2f}, target >= {r["target"]}'
                     for n, r in results.items() if r['target'] and r['ratio']]
                  + ['zoo peak: JAX allocator peak_bytes_in_use (null on CPU); torch peak: '
                     'torch.cuda.max_memory_allocated (null on CPU)', *notes]))
  save(info, peak, args, results, notes, ratios)
  print('wrote', args.out)


def zoo_ratios(results: dict) -> list:
  """ZOO_RATIOS of the rows measured: zoo against itself at another setting, same run."""
  out = []
  for name, a, b, key, least, most in ZOO_RATIOS:
    top, bottom = (results.get(n, {}).get('zoo', {}).get(key) for n in (a, b))
    if top and bottom:
      ratio = top / bottom
      out.append({'name': name, 'ratio': ratio, 'target': f'>= {least}' + (
          f', <= {most}' if most else ''), 'met': least <= ratio <= (most or float('inf'))})
  return out


def save(info: dict, peak: float | None, args, results: dict, notes: list,
         ratios: list = ()) -> None:
  """--out: the machine, and every row measured so far."""
  with open(args.out, 'w', encoding='utf-8') as f:
    json.dump({**info, 'peak_flops': peak, 'smoke': args.smoke, 'steps': args.steps,
               'log_every': args.log_every, 'rows': results, 'zoo_ratios': list(ratios),
               'notes': notes}, f, indent=2)


def parse_args():
  p = argparse.ArgumentParser(description=' '.join(__doc__.split('\n\n')[0].split()))
  p.add_argument('--rows', default='', help=f'Comma-separated, of {", ".join(ROWS)} (default all).')
  p.add_argument('--steps', type=int, default=None, help='Train steps per run (100; smoke 6).')
  p.add_argument('--log_every', type=int, default=None, help='Steps per timed block (10; smoke 2).')
  p.add_argument('--out', default='gpu_bench.json')
  p.add_argument('--data_dir', default='', help='The BPE token dataset: reused if prepared, '
                 'else written there (default: a temporary directory).')
  p.add_argument('--tmp_dir', default=None, help='Where workdirs go (a 1b checkpoint is 12 GB).')
  p.add_argument('--zoo_flags', default='', help='More zoo.main flags for every zoo row, e.g. '
                 '"--config.model.embedding_grad=sorted" to measure that gradient.')
  p.add_argument('--smoke', action='store_true', help='Tiny shapes, a few steps, CPU allowed.')
  p.add_argument('--no_compile', action='store_true', help='The peer runs eager (smoke on CPU).')
  p.add_argument('--probe', action='store_true', help=argparse.SUPPRESS)
  p.add_argument('--torch_row', default='', help=argparse.SUPPRESS)
  p.add_argument('--result', default='', help=argparse.SUPPRESS)
  args = p.parse_args()
  args.steps = args.steps or (6 if args.smoke else 100)
  args.log_every = args.log_every or (2 if args.smoke else 10)
  if args.steps < 2 * args.log_every:
    p.error('--steps must be at least 2 x --log_every: the first block includes compilation')
  return args


if __name__ == '__main__':
  sys.path.insert(0, ROOT)
  _args = parse_args()
  if _args.probe:
    probe()
  elif _args.torch_row:
    torch_row(_args)
  else:
    bench(_args)
