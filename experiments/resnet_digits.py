r"""ResNet with BatchNorm on the scikit-learn handwritten digits (8x8).

    python -m zoo.main --config=experiments/resnet_digits.py --workdir=runs/resnet_digits

Two stages of basic blocks (8x8, then 4x4). BatchNorm statistics are computed over the
global batch on any mesh, kept in the train state and checkpointed; eval uses their
running averages. Expect: 99.7% test accuracy after 1,000 steps, about 65 s on a 2-core
CPU (one device, whole command). `:smoke`: one block per stage, seconds.
"""
from zoo.run.config import base_config


def get_config(arg=None):
  c = base_config()
  c.model.name = 'resnet'
  c.model.stage_sizes = (2, 2)   # Basic blocks per stage.
  c.model.features = (32, 64)    # Channels per stage; a block's inner conv is split over 'model'.
  c.data.name = 'digits'
  c.train.steps = 1000
  c.train.batch_size = 128
  c.train.log_every_steps = 100
  c.optimizer.learning_rate = 2e-3
  c.optimizer.warmup_steps = 50
  c.optimizer.weight_decay = 1e-4
  c.eval.every_steps = 250
  c.eval.batch_size = 120
  c.checkpoint.every_steps = 250
  if arg == 'smoke':
    c.model.stage_sizes = (1, 1)
    c.model.features = (8, 16)
    c.train.steps = 60
    c.train.log_every_steps = 10
    c.optimizer.learning_rate = 1e-2
    c.optimizer.warmup_steps = 5
    c.eval.every_steps = 30
    c.checkpoint.every_steps = 30
  elif arg:
    raise ValueError(f'unknown variant {arg!r} of resnet_digits; known: smoke')
  return c
