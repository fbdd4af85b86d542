r"""Rollout benchmark: zoo's rollouts against transformers' `generate`, same model, same CPU.

    python benchmarks/rollout_bench.py [--out=rollout_bench.json] [--repeats=3]

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
Best of --repeats runs each. Prints a table and writes it as JSON.
"""
import argparse
import functools
import json
import os
import sys
import tempfile
import time

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # pylint: disable=wrong-import-position

import tables  # pylint: disable=wrong-import-position  # benchmarks/tables.py

LLAMA = dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
             rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
PROMPTS, SAMPLES, PROMPT_LEN, NEW = 2, 8, 64, 256
STOPS = tuple(range(7, LLAMA['vocab_size'], 32))  # 1 in 32 ids.


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
  args = parser.parse_args()

  import jax  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  from zoo.data import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
  from zoo.hf import transfer  # pylint: disable=import-outside-toplevel
  from zoo.models import decode  # pylint: disable=import-outside-toplevel
  from zoo.store import checkpoint  # pylint: disable=import-outside-toplevel

  root = tempfile.mkdtemp(prefix='zoo-rollout-bench-')
  torch.manual_seed(0)
  hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).eval()
  hf.save_pretrained(os.path.join(root, 'hf'))
  tokenizer_lib.bytes_tokenizer().save(os.path.join(root, 'hf', 'tokenizer.json'))
  setup = transfer.import_model(os.path.join(root, 'hf'), os.path.join(root, 'run'))
  rng = np.random.default_rng(0)
  prompts = rng.integers(1, LLAMA['vocab_size'], (PROMPTS, PROMPT_LEN)).astype(np.int32)
  rows = np.repeat(prompts, SAMPLES, axis=0)
  pad = np.zeros(len(rows), np.int32)
  new_tokens = {}
  seconds = {}
  with setup.scope():
    params, _, _ = checkpoint.restore_params(os.path.join(root, 'run'),
                                             setup.abstract_state().params)
    for case, stops in (('full', ()), ('early', STOPS)):
      roll = jax.jit(functools.partial(decode.rollout, setup.model, num_tokens=NEW,
                                       stop_ids=stops))
      roll.lower(params, rows, pad, rng=jax.random.key(0)).compile()
      seconds['zoo', case], out = _best(
          lambda: jax.block_until_ready(roll(params, rows, pad, rng=jax.random.key(0))),
          args.repeats)
      new_tokens['zoo', case] = int(out['lengths'].sum())
  torch_rows = torch.from_numpy(rows.astype(np.int64))
  with torch.no_grad():
    for case, stops in (('full', None), ('early', list(STOPS))):
      generate = lambda stops=stops: hf.generate(
          torch_rows, attention_mask=torch.ones_like(torch_rows), do_sample=True,
          temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=NEW,
          min_new_tokens=NEW if stops is None else 0, eos_token_id=stops, pad_token_id=0)
      generate()  # Warm-up.
      seconds['transformers', case], out = _best(generate, args.repeats)
      completions = out[:, PROMPT_LEN:].numpy()
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
      'torch_threads': torch.get_num_threads(), 'jax_devices': jax.device_count()}
  tables.print_rows('rollouts: new tokens/s, compile excluded (best of --repeats)', rows_out)
  print(json.dumps(summary, indent=1))
  with open(args.out, 'w', encoding='utf-8') as f:
    json.dump({'rows': rows_out, 'summary': summary, 'shape': {
        'model': LLAMA, 'prompts': PROMPTS, 'samples': SAMPLES, 'prompt_len': PROMPT_LEN,
        'new_tokens': NEW, 'stop_ids': len(STOPS)}}, f, indent=1)


if __name__ == '__main__':
  main()
