r"""Vision Transformer on the scikit-learn handwritten digits (8x8, 2x2 patches).

    python -m zoo.main --config=experiments/vit_digits.py --workdir=runs/vit_digits

16 patches plus a class token, pre-norm blocks with heads and MLP units split over the
'model' mesh axis. Expect: 98.3% test accuracy after 1,500 steps, about 2 minutes on a
2-core CPU (one device, whole command). `:smoke`: one small block, seconds.
"""
from zoo.run.config import base_config


def get_config(arg=None):
  c = base_config()
  c.model.name = 'vit'
  c.model.patch_size = 2
  c.model.num_layers = 4
  c.model.d_model = 64
  c.model.num_heads = 4          # Split over the 'model' mesh axis.
  c.model.mlp_dim = 128          # Split over the 'model' mesh axis.
  c.model.pool = 'cls'           # Or 'mean'.
  c.model.scan_layers = False
  c.model.remat = 'none'
  c.model.dtype = 'float32'
  c.model.dropout_rate = 0.1
  c.data.name = 'digits'
  c.train.steps = 1500
  c.train.batch_size = 128
  c.train.log_every_steps = 100
  c.optimizer.learning_rate = 1e-3
  c.optimizer.warmup_steps = 100
  c.optimizer.weight_decay = 0.05
  c.eval.every_steps = 500
  c.eval.batch_size = 120
  c.checkpoint.every_steps = 500
  if arg == 'smoke':
    c.model.num_layers = 1
    c.model.d_model = 32
    c.model.mlp_dim = 64
    c.model.dropout_rate = 0.0
    c.train.steps = 60
    c.train.log_every_steps = 10
    c.optimizer.learning_rate = 3e-3
    c.optimizer.warmup_steps = 5
    c.eval.every_steps = 30
    c.checkpoint.every_steps = 30
  elif arg:
    raise ValueError(f'unknown variant {arg!r} of vit_digits; known: smoke')
  return c
