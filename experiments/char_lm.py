r"""Character-level decoder-only Transformer on English prose shipped with Python.

    python -m zoo.main --config=experiments/char_lm.py --workdir=runs/char_lm

The corpus is `pydoc_data.topics` (~465k characters of the Python language reference;
set --config.data.path=FILE to train on your own UTF-8 text). Each eval prints a sample.
Expect: 2.22 held-out bits per character (the corpus's unigram entropy is 4.69) after
600 steps, about 6 minutes on a 2-core CPU (one device, whole command); the samples turn
from spaces to word-like text with code punctuation. `:smoke`: seconds, ~4 bits/char.
`:fsdp` (or `:smoke,fsdp`) shards parameters and optimizer state over 'batch' as well.

`:long` trains on 1,024 characters of context (8x) with context parallelism: the sequence
split over every device on a 'context' mesh axis, 4 rows a step (as many tokens as the base);
`--cpu_devices=8` emulates 8 devices (docs/meshes.md, context parallelism).

`:100m` and `:1b` are GPT-sized decoders (86M and 1.0B parameters; bf16 compute, 1,024
characters of context, scanned layers) for measuring throughput and MFU on an
accelerator: this corpus is far too small to train them well. Plan one before running it:
`--cpu_devices=1 --dry_run --device_memory_gib=60` prints bytes and FLOPs for one H100
(JAX takes 75% of its 80 GB by default; XLA_PYTHON_CLIENT_MEM_FRACTION changes that).
"""
from ml_collections.config_dict import placeholder

from zoo.parallel.sharding import fsdp_rules
from zoo.run.config import base_config, model_config


def get_config(arg=None):
  variants = set(arg.split(',')) if arg else set()
  if variants - {'smoke', 'fsdp', 'long', '100m', '1b'} or len(variants & {'long', '100m', '1b'}) > 1:
    raise ValueError(f'unknown variant {arg!r} of char_lm; known: smoke, fsdp, long (e.g. '
                     'smoke,long), 100m, 1b')
  c = base_config()
  # Every transformer_lm field is a key here (model_config: those left out keep the module's
  # defaults), so a command line sets any of them: a Llama-shaped run is rotary, rms, swiglu,
  # num_kv_heads, rope_theta (zoo/models/transformer.py, docs/configuration.md).
  c.model = model_config(
      'transformer_lm',
      num_layers=4,
      d_model=128,
      num_heads=8,               # Split over the 'model' mesh axis: up to 8 ways.
      mlp_dim=512,               # Split over the 'model' mesh axis.
      max_len=128,
      positions='learned',       # Or 'rotary'.
      scan_layers=False,         # True: one compiled block, params stacked on a 'layers' axis.
      remat='none',              # 'full', 'dots', 'dots_no_batch': recompute in the backward pass.
      dtype='float32',           # 'bfloat16': bf16 compute, f32 params, f32 softmax and loss.
      dropout_rate=0.0,
      attention='auto',          # cuDNN's kernel on GPUs, splash on TPUs, else 'xla'.
      norm='layer',              # Or 'rms'.
      norm_epsilon=1e-6,
      mlp_activation='gelu',     # Or 'gelu_exact', 'swiglu'.
      num_kv_heads=placeholder(int),  # None: num_heads; fewer: grouped-query attention.
      vocab_size=placeholder(int))    # None: the data's; larger pads the vocabulary.
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
  if variants & {'100m', '1b'}:     # Throughput on an accelerator; see the docstring.
    c.model.update(max_len=1024, dtype='bfloat16', scan_layers=True)
    c.data.seq_len = 1024
    c.train.steps = 300
    c.optimizer.learning_rate = 3e-4
    c.optimizer.warmup_steps = 30
    c.eval.every_steps = c.checkpoint.every_steps = 300
    c.eval.batch_size = 16
  if 'long' in variants:           # 8x the context, split over a 'context' axis.
    c.model.update(max_len=1024, positions='rotary')
    c.data.seq_len = 1024
    c.mesh.axes = ('batch', 'context', 'model')
    c.mesh.shape = (1, -1, 1)      # Every device on 'context': 8 x 128 positions on 8.
    c.train.batch_size = 4         # Fewer rows than devices; as many tokens as the base.
    c.eval.batch_size = 8
  if '100m' in variants:           # 12 x (4 x 768^2 + 2 x 768 x 3072) = 85M in the blocks.
    c.model.update(num_layers=12, d_model=768, num_heads=12, mlp_dim=3072, remat='dots_no_batch')
    c.train.batch_size = 32
  if '1b' in variants:             # 20 x (4 x 2048^2 + 2 x 2048 x 8192) = 1.0B in the blocks.
    c.model.update(num_layers=20, d_model=2048, num_heads=16, mlp_dim=8192, remat='dots_no_batch')
    c.train.batch_size = 16
  if 'smoke' in variants:
    c.model.num_layers = 2
    c.model.d_model = 64
    c.model.num_heads = 8
    c.model.mlp_dim = 128
    c.model.max_len = c.data.seq_len = 256 if 'long' in variants else 32
    c.train.steps = 80
    c.train.batch_size = 16
    c.train.log_every_steps = 10
    c.optimizer.warmup_steps = 5
    c.eval.every_steps = 40
    c.eval.batch_size = 16
    c.eval.max_batches = 2
    c.checkpoint.every_steps = 40
  return c
