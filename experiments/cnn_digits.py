r"""LeNet-style CNN on the scikit-learn handwritten digits (8x8).

    python -m zoo.main --config=experiments/cnn_digits.py --workdir=runs/cnn_digits

Expect: 97.8% test accuracy after 1,000 steps, about 14 s on a 2-core CPU (one device,
whole command). `:smoke` runs 60 steps in seconds and reaches ~75%.
"""
from zoo.run.config import base_config


def get_config(arg=None):
  c = base_config()
  c.model.name = 'cnn'
  c.model.features = (32, 64)    # Conv channels: split over 'model' on output, then input.
  c.model.hidden = 128
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
    c.model.features = (8, 16)
    c.model.hidden = 32
    c.train.steps = 60
    c.train.log_every_steps = 10
    c.optimizer.learning_rate = 1e-2
    c.optimizer.warmup_steps = 5
    c.eval.every_steps = 30
    c.checkpoint.every_steps = 30
  elif arg:
    raise ValueError(f'unknown variant {arg!r} of cnn_digits; known: smoke')
  return c
