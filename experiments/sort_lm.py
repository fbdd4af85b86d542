r"""A small language model taught to sort digits (zoo.data.sorting): the starting point that
DPO (experiments/dpo_lm.py) and GRPO tune, on 2 CPU cores.

    python -c "from zoo.data import sorting; sorting.write('data/sort')"
    python -m zoo.prepare text --input=data/sort/sft.jsonl --output=data/sort_sft \
        --tokenizer=bytes --val_fraction=0.05
    python -m zoo.main --config=experiments/sort_lm.py --workdir=runs/sort
    python -m zoo.prepare preference --input=data/sort/pairs.jsonl --output=data/sort_pairs \
        --tokenizer=runs/sort --val_fraction=0.1
    python -m zoo.main --config=experiments/dpo_lm.py:runs/sort --workdir=runs/sort_dpo \
        --config.data.path=data/sort_pairs

Each document is `sort 3 1 4 1 5 9: 1 1 3 4 5 9` in bytes, packed into windows; the steps
are deliberately few (360, 26 s on 2 cores), so that the model sorts most prompts but not
all (63% of held-out prompts greedily; after 1,000 steps, all) and post-training has
something to fix. A Llama-layout decoder (rotary positions, RMSNorm, SwiGLU) of 0.15M
parameters. `:smoke`: seconds.

    python -m zoo.prepare prompts --input=data/sort/prompts.jsonl --output=data/sort_prompts \
        --tokenizer=runs/sort --val_fraction=0.3
    python -m zoo.main --config=experiments/grpo_sort.py:runs/sort --workdir=runs/sort_grpo \
        --config.data.path=data/sort_prompts
"""
from zoo.run.config import base_config, model_config


def get_config(arg=None):
  variants = set(arg.split(',')) if arg else set()
  if variants - {'smoke'}:
    raise ValueError(f'unknown variant {arg!r} of sort_lm; known: smoke')
  c = base_config()
  c.model = model_config(
      'transformer_lm', num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, mlp_dim=192,
      max_len=64, positions='rotary', norm='rms', mlp_activation='swiglu', use_bias=False,
      tie_embeddings=False, dtype='float32', dropout_rate=0.0, scan_layers=False,
      remat='none', vocab_size=257)
  c.data.name = 'tokens'
  c.data.path = 'data/sort_sft'
  c.data.seq_len = 64
  c.train.steps = 360
  c.train.batch_size = 32
  c.train.log_every_steps = 50
  c.optimizer.learning_rate = 3e-3
  c.optimizer.warmup_steps = 30
  c.optimizer.weight_decay = 0.0
  c.eval.every_steps = 120
  c.eval.batch_size = 32
  c.eval.max_batches = 0
  c.eval.sample_temperature = 0.0
  c.checkpoint.every_steps = 360
  if 'smoke' in variants:
    c.train.update(steps=6, batch_size=8, log_every_steps=2)
    c.eval.update(every_steps=3, batch_size=8, max_batches=2)
    c.checkpoint.every_steps = 3
  return c
