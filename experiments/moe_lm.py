r"""A mixture-of-experts character LM: char_lm's data, every MLP routed experts.

    python -m zoo.main --config=experiments/moe_lm.py --workdir=runs/moe_lm

8 experts per layer, 2 per token (Mixtral's routing: softmax, top 2, renormalised),
dropless (zoo.models.moe), SwiGLU experts of 128 units on a 128-wide, 4-layer rotary
decoder; the load-balance loss at 0.01 and the router z-loss at 0.001. Each logged row of
metrics.jsonl and TensorBoard has `train/moe/...`: the two router losses, and per layer the
busiest and idlest expert's share of the routed rows (`load_max`, `load_min`; 1 is even),
the router's entropy and the fraction of rows dropped. Expect 1.87 held-out bits per
character after 600 steps (char_lm's dense decoder: 2.22), in about 23 minutes on a busy
2-core CPU (ragged_dot runs a dense masked product over all 8 experts there). `:smoke`:
seconds, ~4 bits/char.

Expert parallelism: `:ep` (or `:smoke,ep`) adds an 'expert' mesh axis that splits the
experts (and, like 'batch', the batch): mesh (-1, 4, 1) over ('batch', 'expert', 'model'),
each device holding 2 of the 8 experts, tokens moving to them and back by all-to-all. The
rules are zoo.parallel.sharding.expert_rules(fsdp_rules()), which name 'expert' and so also
run on a mesh without that axis; any mesh.axes/mesh.shape works from the command line, e.g.
--config.mesh.axes="('batch','expert','model')" --config.mesh.shape="(2,2,2)".
`model.expert_buffer` bounds what a device receives (in multiples of what it sends; 0, the
default, is the worst case): rows beyond it are dropped and counted in `dropped`.
"""
from zoo.parallel.sharding import expert_rules, fsdp_rules
from zoo.run.config import base_config, model_config


def get_config(arg=None):
  variants = set(arg.split(',')) if arg else set()
  if variants - {'smoke', 'ep'}:
    raise ValueError(f'unknown variant {arg!r} of moe_lm; known: smoke, ep (e.g. smoke,ep)')
  c = base_config()
  c.model = model_config(
      'transformer_lm',
      num_layers=4,
      d_model=128,
      num_heads=8,
      mlp_dim=512,               # Unused by routed layers; dense_layers keep it.
      max_len=128,
      positions='rotary',
      norm='rms',
      mlp_activation='swiglu',
      num_experts=8,             # Each MLP: 8 experts; 'experts' may split over an expert axis.
      experts_per_token=2,
      expert_mlp_dim=128,        # Each expert's hidden units (split over 'model').
      norm_topk_prob=True,       # Mixtral: the two gates sum to 1.
      capacity_factor=0.0,       # 0: dropless; > 0: GShard's capacity (drops counted).
      expert_buffer=0.0,         # Expert parallelism's receive buffer; 0: the worst case.
      router_aux_coef=0.01,      # Load balance (Hugging Face's convention: k when balanced).
      router_z_coef=0.001,       # ST-MoE's router z-loss.
      vocab_size=None)           # The data's.
  c.data.name = 'text'
  c.data.path = ''               # Empty: Python's bundled docs. Else a UTF-8 text file.
  c.data.seq_len = 128
  c.logical_axis_rules = expert_rules(fsdp_rules())  # 'expert' rules drop out without the axis.
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
  if 'ep' in variants:
    c.mesh.axes = ('batch', 'expert', 'model')
    c.mesh.shape = (-1, 4, 1)
    c.mesh.dcn_shape = (1, 1, 1)
  if 'smoke' in variants:
    c.model.update(num_layers=2, d_model=64, num_heads=4, expert_mlp_dim=64, max_len=32)
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
