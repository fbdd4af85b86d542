r"""Decoding and import benchmark: KV-cache tokens/s, and host memory of a large import.

    python benchmarks/decode_bench.py [--out=decode_bench.json] [--skip=decode,import]

Prints a table per part and writes them as JSON (one CPU device):
  decode   a decoder LM (4 layers, d=128, 8 heads, vocabulary 8,192, max_len 1,024) with
           random weights continues a 512-token prompt by 512 tokens, greedily: the
           key/value cache (zoo.models.decode.generate_cached: prefill, then one token per step)
           against recomputing the window per token (zoo.models.decode.generate); compile excluded,
           best of --repeats for the cache, one run for the recompute path (minutes long);
           batch 1 and 8 (goal: >= 10x)
  import   a generated ~300M-parameter Llama-layout checkpoint (float32 safetensors in 3
           shards, grouped-query attention) imported by `zoo.convert import` in a fresh
           process: wall time, and peak RSS beyond the process before the tensors and the
           imported state's own bytes, against the largest tensor (goal: <= 1.5x)
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # pylint: disable=wrong-import-position

import tables  # pylint: disable=wrong-import-position  # benchmarks/tables.py

LLAMA = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=24,
             num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
             rms_norm_eps=1e-5, rope_theta=10000.0)


def decode(repeats):
  import functools  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  from zoo.models import decode as dec  # pylint: disable=import-outside-toplevel
  from zoo.models.transformer_lm import TransformerLM  # pylint: disable=import-outside-toplevel
  model = TransformerLM(vocab_size=8192, num_layers=4, d_model=128, num_heads=8, mlp_dim=512,
                        max_len=1024, positions='rotary')
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  params = jax.jit(lambda: nn.meta.unbox(model.init(jax.random.key(0),
                                                    np.zeros((1, 8), np.int32))['params']))()
  rows = []
  for batch in (1, 8):
    prompt = np.random.default_rng(0).integers(0, 8192, (batch, 512)).astype(np.int32)
    cached = jax.jit(functools.partial(dec.generate_cached, model, num_tokens=512,
                                       temperature=0.0))
    recompute = jax.jit(functools.partial(dec.generate, model.apply, prompt_len=512, window=1024,
                                          temperature=0.0))
    tokens = np.concatenate([prompt, np.zeros((batch, 512), np.int32)], 1)
    pad = np.zeros(batch, np.int32)
    args = {'cache': (params, prompt, pad), 'recompute': ({'params': params}, tokens)}
    seconds, outputs = {}, {}
    for name, fn in (('cache', cached), ('recompute', recompute)):
      compiled = fn.lower(*args[name], rng=jax.random.key(0)).compile()  # Compile, not timed.
      best = float('inf')
      for _ in range(repeats if name == 'cache' else 1):  # Recompute: minutes; one run.
        t0 = time.perf_counter()
        outputs[name] = np.asarray(jax.block_until_ready(compiled(*args[name],
                                                                  rng=jax.random.key(0))))
        best = min(best, time.perf_counter() - t0)
      seconds[name] = best
      print(f'  batch {batch} {name}: {best:.2f} s', flush=True)
    rows.append({'batch': batch, 'new_tokens': 512, 'cache_s': seconds['cache'],
                 'recompute_s': seconds['recompute'],
                 'cache_tokens_per_s': batch * 512 / seconds['cache'],
                 'recompute_tokens_per_s': batch * 512 / seconds['recompute'],
                 'speedup': seconds['recompute'] / seconds['cache'],
                 'same_tokens': bool(np.array_equal(outputs['cache'], outputs['recompute']))})
  return rows


def write_llama(directory):
  """A Llama-layout HF directory of random float32 weights, written shard by shard."""
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  from zoo.hf import layouts as hf  # pylint: disable=import-outside-toplevel
  from zoo.data import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
  os.makedirs(directory, exist_ok=True)
  config = {'model_type': 'llama', 'architectures': ['LlamaForCausalLM'], **LLAMA}
  tensors = hf.ARCHITECTURES['llama'].tensors(hf.ARCHITECTURES['llama'].from_hf(config))
  rng = np.random.default_rng(0)
  shards = [tensors[:len(tensors) // 3], tensors[len(tensors) // 3:2 * len(tensors) // 3],
            tensors[2 * len(tensors) // 3:]]
  weight_map, total = {}, 0
  for i, shard in enumerate(shards):
    name = f'model-{i + 1:05d}-of-00003.safetensors'
    arrays = {t.name: (rng.standard_normal(t.shape, np.float32) * 0.02) for t in shard}
    save_file(arrays, os.path.join(directory, name), metadata={'format': 'pt'})
    weight_map.update({n: name for n in arrays})
    total += sum(a.nbytes for a in arrays.values())
    del arrays
  with open(os.path.join(directory, 'model.safetensors.index.json'), 'w', encoding='utf-8') as f:
    json.dump({'metadata': {'total_size': total}, 'weight_map': weight_map}, f)
  with open(os.path.join(directory, 'config.json'), 'w', encoding='utf-8') as f:
    json.dump(config, f)
  tokenizer_lib.bytes_tokenizer().save(os.path.join(directory, 'tokenizer.json'))
  largest = max(np.prod(t.shape) * 4 for t in tensors)
  params = sum(int(np.prod(t.shape)) for t in tensors)
  return total, int(largest), params


_MEASURE = r'''
import os, resource, sys, time
os.environ['JAX_PLATFORMS'] = 'cpu'
sys.path.insert(0, sys.argv[3])
from zoo.hf import transfer
def rss():  # Current resident set, MB.
  with open('/proc/self/statm') as f:
    return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE') / 2**20
import jax
jax.numpy.zeros(1).block_until_ready()
original = transfer._read
state = {}
def first_read(*args):  # The process just before the first tensor: imports, setup, compile.
  state.setdefault('before', rss())
  return original(*args)
transfer._read = first_read
t0 = time.perf_counter()
transfer.import_model(sys.argv[1], sys.argv[2])
print('RESULT', state['before'], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
      time.perf_counter() - t0)
'''


def import_memory(root):
  hf_dir = os.path.join(root, 'llama_300m')
  t0 = time.perf_counter()
  file_bytes, largest, params = write_llama(hf_dir)
  write_s = time.perf_counter() - t0
  out = subprocess.run([sys.executable, '-c', _MEASURE, hf_dir, os.path.join(root, 'imported'),
                        ROOT], capture_output=True, text=True, check=True,
                       env={k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'})
  before, peak, seconds = (float(x) for x in out.stdout.split('RESULT')[1].split())
  padded = params + (32768 - 32000) * 1024 * 2  # Embedding and head padded to 128s of rows.
  state_mb = padded * 4 / 2**20
  excess = peak - before - state_mb
  return [{'params': params, 'safetensors_mb': file_bytes / 2**20, 'write_s': write_s,
           'import_s': seconds, 'rss_before_tensors_mb': before, 'peak_rss_mb': peak,
           'state_mb': state_mb, 'largest_tensor_mb': largest / 2**20,
           'excess_over_largest': excess / (largest / 2**20)}]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--out', default='decode_bench.json')
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--skip', default='')
  args = parser.parse_args()
  skip = set(filter(None, args.skip.split(',')))
  results = {'machine': {'cpus': os.cpu_count()}}
  with tempfile.TemporaryDirectory() as root:
    for name, fn in (('decode', lambda: decode(args.repeats)),
                     ('import', lambda: import_memory(root))):
      if name not in skip:
        results[name] = fn()
        tables.print_rows(name, results[name])
        with open(args.out, 'w', encoding='utf-8') as f:
          json.dump(results, f, indent=2)
  print(f'\nwrote {args.out}')


if __name__ == '__main__':
  main()
