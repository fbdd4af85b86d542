r"""MLP on the scikit-learn handwritten digits (8x8), Megatron-style hidden layers.

    python -m zoo.main --config=experiments/mlp_digits.py --workdir=runs/mlp_digits

Expect: 98.6% test accuracy after 1,000 steps, about 6 s on a 2-core CPU (one device,
whole command). `:smoke` runs 60 steps in seconds and reaches ~90%.
"""
from zoo.run.config import base_config


def get_config(arg=None):
  c = base_config()
  c.model.name = 'mlp'
  c.model.hidden_sizes = (256, 256)  # Alternately split on output, then input axis.
  c.data.name = 'digits'
  c.train.steps = 1000
  c.train.batch_size = 128
  c.train.log_every_steps = 100
  c.optimizer.learning_rate = 1e-3
  c.optimizer.warmup_steps = 50
  c.optimizer.weight_decay = 1e-4
  c.eval.every_steps = 250
  c.eval.batch_size = 120
  c.checkpoint.every_steps = 250
  if arg == 'smoke':
    c.model.hidden_sizes = (64, 64)
    c.train.steps = 60
    c.train.log_every_steps = 10
    c.optimizer.learning_rate = 3e-3
    c.optimizer.warmup_steps = 5
    c.eval.every_steps = 30
    c.checkpoint.every_steps = 30
  elif arg:
    raise ValueError(f'unknown variant {arg!r} of mlp_digits; known: smoke')
  return c
