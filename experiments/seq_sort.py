r"""Encoder-decoder Transformer learning to sort 8 digits, a task with a known answer.

    python -m zoo.main --config=experiments/seq_sort.py --workdir=runs/seq_sort

Source "31415926" (8 tokens), target "11234569", drawn fresh every step; 1000 held-out
sources (disjoint from training, see zoo/data/seq.py) are scored by exact match: the
fraction sorted entirely right, which equals greedy decoding's (see zoo.run.tasks.Seq2Seq).
Expect: 100% exact match (98.4% at step 500) in about 3 minutes on a 2-core CPU.
`--config.data.problem=add --config.data.digits=5` learns 5-digit addition instead (much
harder for this small model, see README), `reverse` reverses. `:smoke`: seconds.
"""
from zoo.run.config import base_config


def get_config(arg=None):
  c = base_config()
  c.model.name = 'encoder_decoder'
  c.model.num_layers = 2         # Encoder blocks, and as many decoder blocks.
  c.model.d_model = 128
  c.model.num_heads = 4          # Split over the 'model' mesh axis.
  c.model.mlp_dim = 512          # Split over the 'model' mesh axis.
  c.model.max_len = 16
  c.model.positions = 'learned'  # Or 'rotary', with the rotary switches below.
  c.model.rope_theta = 10000.0   # Rotary base; rope_scaling 'linear', 'llama3' or 'yarn' with
  c.model.rope_scaling = 'none'  # its factors (docs/configuration.md, zoo/models/rope.py).
  c.model.rope_factor = 1.0
  c.model.rope_original_max_len = 0
  c.model.rope_low_freq_factor = 1.0
  c.model.rope_high_freq_factor = 4.0
  c.model.rope_beta_fast = 32.0
  c.model.rope_beta_slow = 1.0
  c.model.rope_attention_factor = 0.0
  c.model.scan_layers = False    # True: one compiled block per side, params on a 'layers' axis.
  c.model.remat = 'none'         # 'full', 'dots', 'dots_no_batch': recompute in the backward pass.
  c.model.dtype = 'float32'      # 'bfloat16': bf16 compute, f32 params.
  c.model.dropout_rate = 0.0
  c.data.name = 'seq'
  c.data.problem = 'sort'        # sort, add or reverse.
  c.data.digits = 8
  c.data.num_eval = 1000
  c.train.steps = 1500
  c.train.batch_size = 128
  c.train.log_every_steps = 100
  c.optimizer.learning_rate = 3e-3
  c.optimizer.warmup_steps = 100
  c.optimizer.weight_decay = 0.01
  c.optimizer.b2 = 0.98
  c.eval.every_steps = 500
  c.eval.batch_size = 200
  c.checkpoint.every_steps = 500
  if arg == 'smoke':
    c.model.num_layers = 1
    c.model.d_model = 32
    c.model.num_heads = 4
    c.model.mlp_dim = 64
    c.data.digits = 4              # 103 distinct held-out sources: enough for num_eval.
    c.data.num_eval = 64
    c.train.steps = 60
    c.train.batch_size = 32
    c.train.log_every_steps = 10
    c.optimizer.warmup_steps = 5
    c.eval.every_steps = 30
    c.eval.batch_size = 32
    c.checkpoint.every_steps = 30
  elif arg:
    raise ValueError(f'unknown variant {arg!r} of seq_sort; known: smoke')
  return c
