r"""Rollout benchmark: zoo's rollouts against transformers' `generate`, same model, same device.

    python benchmarks/rollout_bench.py [--out=rollout_bench.json] [--repeats=3] [--gpu] [--large]

A random Llama-layout model (4 layers, d=256, 8 heads, 4 key/value heads, vocabulary
4,096) saved by transformers and imported by `zoo.convert import`; 16 rows (2 prompts x 8
completions) of 64 prompt tokens sampled at temperature 1 for 256 new tokens:
  full    every row runs to the budget (no stop id): new tokens/s of
          zoo.models.decode.rollout (jitted, compile excluded, per-token log-probs included)
          and of transformers' `generate` (do_sample, its KV cache; float32, the torch
          threads of this machine). Goal: zoo >= 2x.
  early   the same, with 1 in 32 token ids as stop ids (each row ends at its first): wall
          time of zoo's batch against its full batch (goal: >= 1.5x faster), and
          transformers' with the same ids as its eos_token_id.
--large: a 16-layer model (d=1,024, 16 heads, 8 key/value heads, vocabulary 32,000;
0.23B parameters), 64 rows (8 prompts x 8) of 128 prompt tokens, 512 new tokens.
--gpu: both on the first GPU (jax's CUDA platform; torch's cuda, synchronised before the
clock stops), float32 both. Best of --repeats runs each. Prints a table and writes it as
JSON.
"""
import argparse
import functools
import json
import os
import sys
import tempfile
import time

if '--gpu' not in sys.argv:
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # pylint: disable=wrong-import-position

import tables  # pylint: disable=wrong-import-position  # benchmarks/tables.py

LLAMA = dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
             rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
PROMPTS, SAMPLES, PROMPT_LEN, NEW = 2, 8, 64, 256
LARGE = dict(LLAMA, vocab_size=32000, hidden_size=1024, intermediate_size=2816,
             num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
             max_position_embeddings=1024)
LARGE_SHAPE = 8, 8, 128, 512


def _best(fn, repeats):
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    out = fn()
    times.append(time.perf_counter() - start)
  return min(times), out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--out', default='rollout_bench.json')
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--gpu', action='store_true', help='both libraries on the GPU')
  parser.add_argument('--large', action='store_true', help='the 0.23B model, 64 x (128 + 512)')
  args = parser.parse_args()
  llama = LARGE if args.large else LLAMA
  prompts_n, samples, prompt_len, new = LARGE_SHAPE if args.large else (
      PROMPTS, SAMPLES, PROMPT_LEN, NEW)
  stops_ids = tuple(range(7, llama['vocab_size'], 32))  # 1 in 32 ids.

  import jax  # pylint: disable=import-outside-toplevel
  if args.gpu:  # float32 products in full on both sides (torch's default: no TF32).
    jax.config.update('jax_default_matmul_precision', 'highest')
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  from zoo.data import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
  from zoo.hf import transfer  # pylint: disable=import-outside-toplevel
  from zoo.models import decode  # pylint: disable=import-outside-toplevel
  from zoo.store import checkpoint  # pylint: disable=import-outside-toplevel

  root = tempfile.mkdtemp(prefix='zoo-rollout-bench-')
  torch.manual_seed(0)
  hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama)).eval()
  hf.save_pretrained(os.path.join(root, 'hf'))
  tokenizer_lib.bytes_tokenizer().save(os.path.join(root, 'hf', 'tokenizer.json'))
  setup = transfer.import_model(os.path.join(root, 'hf'), os.path.join(root, 'run'))
  rng = np.random.default_rng(0)
  prompts = rng.integers(1, llama['vocab_size'], (prompts_n, prompt_len)).astype(np.int32)
  rows = np.repeat(prompts, samples, axis=0)
  pad = np.zeros(len(rows), np.int32)
  new_tokens = {}
  seconds = {}
  with setup.scope():
    params, _, _ = checkpoint.restore_params(os.path.join(root, 'run'),
                                             setup.abstract_state().params)
    for case, stops in (('full', ()), ('early', stops_ids)):
      roll = jax.jit(functools.partial(decode.rollout, setup.model, num_tokens=new,
                                       stop_ids=stops))
      roll.lower(params, rows, pad, rng=jax.random.key(0)).compile()
      seconds['zoo', case], out = _best(
          lambda: jax.block_until_ready(roll(params, rows, pad, rng=jax.random.key(0))),
          args.repeats)
      new_tokens['zoo', case] = int(out['lengths'].sum())
  device = 'cuda' if args.gpu else 'cpu'
  hf = hf.to(device)
  torch_rows = torch.from_numpy(rows.astype(np.int64)).to(device)

  def generate(stops):
    out = hf.generate(
        torch_rows, attention_mask=torch.ones_like(torch_rows), do_sample=True,
        temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new,
        min_new_tokens=new if stops is None else 0, eos_token_id=stops, pad_token_id=0)
    return out.cpu()  # Waits for the device.
  with torch.no_grad():
    for case, stops in (('full', None), ('early', list(stops_ids))):
      generate(stops)  # Warm-up.
      seconds['transformers', case], out = _best(lambda stops=stops: generate(stops),
                                                 args.repeats)
      completions = out[:, prompt_len:].numpy()
      if stops is None:
        new_tokens['transformers', case] = completions.size
      else:  # Up to each row's first stop id, included.
        hits = np.isin(completions, stops)
        new_tokens['transformers', case] = int(np.where(
            hits.any(1), hits.argmax(1) + 1, completions.shape[1]).sum())
  rows_out = []
  for case in ('full', 'early'):
    for library in ('zoo', 'transformers'):
      rows_out.append({'case': case, 'library': library, 'seconds': seconds[library, case],
                       'new_tokens': new_tokens[library, case],
                       'new_tokens_per_s': new_tokens[library, case] / seconds[library, case]})
  summary = {
      'zoo_over_transformers_full': (rows_out[0]['new_tokens_per_s'] /
                                     rows_out[1]['new_tokens_per_s']),
      'zoo_full_over_early_seconds': seconds['zoo', 'full'] / seconds['zoo', 'early'],
      'torch_threads': torch.get_num_threads(), 'jax_device': str(jax.devices()[0]),
      'torch_device': torch.cuda.get_device_name() if args.gpu else 'cpu'}
  tables.print_rows('rollouts: new tokens/s, compile excluded (best of --repeats)', rows_out)
  print(json.dumps(summary, indent=1))
  with open(args.out, 'w', encoding='utf-8') as f:
    json.dump({'rows': rows_out, 'summary': summary, 'shape': {
        'model': llama, 'prompts': prompts_n, 'samples': samples, 'prompt_len': prompt_len,
        'new_tokens': new, 'stop_ids': len(stops_ids)}}, f, indent=1)


if __name__ == '__main__':
  main()
