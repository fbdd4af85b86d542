r"""The loss's chunks on this machine: what auto chooses and what it costs. Not a test.

    python benchmarks/loss_bench.py [--out=loss_bench.json] [--repeats=3] [--steps=3]

A Llama-layout language model (4 layers, d 256, 4 query / 2 key-value heads, SwiGLU 1,024,
RMSNorm, rotary, an untied head) at a 32,768 vocabulary, 8 rows of 512 tokens, on this
machine's default mesh (on a CPU one emulated device per core, data-parallel), its train
step timed with model.loss_chunks:
  auto   what zoo.run.chunks chooses here (the fewest chunks whose step fits the device),
  1      whole logits,
  lean   the memory-lean rule's count (at most 2^22 logits of a sequence a chunk: 4 here),
         what auto took before it chose for the machine.
Blocks of --steps steps alternate between the three, --repeats times, on the same state
and batch; the table takes each one's best block (noise on a shared machine only adds
time), the JSON every block. Issue 56's target: auto within 10% of whole logits.
"""
import argparse
import json
import os
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..')
sys.path.insert(0, ROOT)

from zoo.parallel import distributed  # pylint: disable=wrong-import-position

# zoo's default on a host without accelerators (before JAX starts): one device per core.
os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count='
                      f'{distributed.cores_as_devices()}')
import jax  # pylint: disable=wrong-import-position,wrong-import-order

from zoo.models import layers  # pylint: disable=wrong-import-position
from zoo.run import chunks  # pylint: disable=wrong-import-position
from zoo.run import setup as setup_lib  # pylint: disable=wrong-import-position
from zoo.run.config import load_experiment  # pylint: disable=wrong-import-position

MODEL = dict(num_layers=4, d_model=256, num_heads=4, num_kv_heads=2, mlp_dim=1024,
             mlp_activation='swiglu', norm='rms', positions='rotary', tie_embeddings=False,
             vocab_size=32768, max_len=512)


def _setup(loss_chunks):
  config = load_experiment(os.path.join(ROOT, 'experiments', 'char_lm.py'), None)
  config.model.update(MODEL, loss_chunks=loss_chunks)
  config.data.seq_len, config.train.batch_size = MODEL['max_len'], 8
  return setup_lib.checked(config)


def as_in(state, s):
  """`state` as `s`'s step takes it: its model's apply and its optimizer (the state's
  static fields; the arrays are the same)."""
  return state.replace(apply_fn=s.model.apply, tx=s.optimizer)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--out', default='loss_bench.json')
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--steps', type=int, default=3)
  args = parser.parse_args()
  auto, choice = chunks.fitted(_setup(0))
  lean = layers.loss_chunks(0, MODEL['max_len'], MODEL['vocab_size'])
  variants = {'auto': auto, '1': _setup(1), 'lean': _setup(lean)}
  state, batch, compiled = None, None, {}
  for name, s in variants.items():
    with s.scope():
      if state is None:  # The parameters do not depend on the chunks: one state for all.
        state = s.create_state()
        local = s.dataset.train_batch(0, s.config.train.batch_size,
                                      slice(0, s.config.train.batch_size))
        batch = jax.device_put(local, s.batch_sharding)
      compiled[name] = s.jit_train_step().lower(as_in(state, s), batch).compile()
  blocks = {name: [] for name in variants}
  for _ in range(args.repeats):
    for name, step in compiled.items():
      state = as_in(state, variants[name])  # One state, donated along one chain of steps.
      jax.block_until_ready(state)
      t0 = time.perf_counter()
      for _ in range(args.steps):
        state, metrics = step(state, batch)
      jax.block_until_ready(metrics)
      blocks[name].append((time.perf_counter() - t0) / args.steps)
  rows = [{'loss_chunks': name, 'chunks': s.model.loss_chunks or lean,
           'best_s_per_step': round(min(blocks[name]), 4),
           'x_whole_logits': round(min(blocks[name]) / min(blocks['1']), 3)}
          for name, s in variants.items()]
  out = {'device': jax.devices()[0].device_kind, 'devices': jax.device_count(),
         'jax': jax.__version__, 'model': MODEL, 'batch': 8, 'auto': choice.line(),
         'rows': rows, 'blocks': blocks}
  with open(args.out, 'w', encoding='utf-8') as f:
    json.dump(out, f, indent=2)
  import tables  # pylint: disable=import-outside-toplevel  # benchmarks/tables.py
  tables.print_rows(f'the train step on {jax.device_count()} {out["device"]} device(s), '
                    f'best of {args.repeats} blocks of {args.steps} steps', rows)
  print(choice.line())
  print('wrote', args.out)


if __name__ == '__main__':
  main()
