r"""Character-level decoder-only Transformer on English prose shipped with Python.

    python -m zoo.main --config=experiments/char_lm.py --workdir=runs/char_lm

The corpus is `pydoc_data.topics` (~465k characters of the Python language reference;
set --config.data.path=FILE to train on your own UTF-8 text). Each eval prints a sample.
Expect: 2.22 held-out bits per character (the corpus's unigram entropy is 4.69) after
600 steps, about 6 minutes on a 2-core CPU (one device, whole command); the samples turn
from spaces to word-like text with code punctuation. `:smoke`: seconds, ~4 bits/char.
`:fsdp` (or `:smoke,fsdp`) shards parameters and optimizer state over 'batch' as well.
"""
from zoo.config import base_config
from zoo.sharding import fsdp_rules


def get_config(arg=None):
  variants = set(arg.split(',')) if arg else set()
  if variants - {'smoke', 'fsdp'}:
    raise ValueError(f'unknown variant {arg!r} of char_lm; known: smoke, fsdp (e.g. smoke,fsdp)')
  c = base_config()
  c.model.name = 'transformer_lm'
  c.model.num_layers = 4
  c.model.d_model = 128
  c.model.num_heads = 8          # Split over the 'model' mesh axis: up to 8 ways.
  c.model.mlp_dim = 512          # Split over the 'model' mesh axis.
  c.model.max_len = 128
  c.model.positions = 'learned'  # Or 'rotary'.
  c.model.scan_layers = False    # True: one compiled block, params stacked on a 'layers' axis.
  c.model.remat = 'none'         # 'full', 'dots', 'dots_no_batch': recompute in the backward pass.
  c.model.dtype = 'float32'      # 'bfloat16': bf16 compute, f32 params, f32 softmax and loss.
  c.model.dropout_rate = 0.0
  c.data.name = 'text'
  c.data.path = ''               # Empty: Python's bundled docs. Else a UTF-8 text file.
  c.data.seq_len = 128
  c.train.steps = 600
  c.train.batch_size = 32
  c.train.log_every_steps = 50
  c.optimizer.learning_rate = 3e-3
  c.optimizer.warmup_steps = 50
  c.optimizer.weight_decay = 0.1
  c.optimizer.b2 = 0.99
  c.eval.every_steps = 200
  c.eval.batch_size = 64
  c.eval.max_batches = 4
  c.checkpoint.every_steps = 200
  if 'fsdp' in variants:           # Parameters' embed axis split over 'batch' (FSDP).
    c.logical_axis_rules = fsdp_rules()
  if 'smoke' in variants:
    c.model.num_layers = 2
    c.model.d_model = 64
    c.model.num_heads = 8
    c.model.mlp_dim = 128
    c.model.max_len = 32
    c.data.seq_len = 32
    c.train.steps = 80
    c.train.batch_size = 16
    c.train.log_every_steps = 10
    c.optimizer.warmup_steps = 5
    c.eval.every_steps = 40
    c.eval.batch_size = 16
    c.eval.max_batches = 2
    c.checkpoint.every_steps = 40
  return c
