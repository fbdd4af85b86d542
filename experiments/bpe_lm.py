r"""Byte-level BPE language model on the Python standard library's own source code.

    STDLIB=$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
    python -m zoo.prepare text --input="$STDLIB/**/*.py" --exclude='*/site-packages/*' \
        --skip_undecodable --output=data/stdlib_bpe --tokenizer=bpe --vocab_size=8192 \
        --val_fraction=0.02
    python -m zoo.main --config=experiments/bpe_lm.py --workdir=runs/bpe_lm

The corpus is every `.py` file of the interpreter's standard library, tests included,
third-party packages (site-packages) and the 4 files that are not UTF-8 left out: 1,786
files, 31.5 MB with CPython 3.11. Each file is a document; a fixed hash of its index puts 2%
of them (42 files, 0.54 MB) in the validation split. The BPE (8,192 tokens, trained on
the training files in about 5 s) averages 3.65 bytes per token. Eval reports bits per byte
over the whole validation split, the measure a byte-level model on the same files
(`--config.data.path` of a `--tokenizer=bytes` preparation) is compared by.

`:mixture` mixes that code (0.8) with prose, the Python docs (0.2), prepared with the same
tokenizer, and reports each source's validation loss and bits per byte (zoo.data.mixture):

    python -c "import json; from pydoc_data import topics; [print(json.dumps({'text': t})) \
        for t in topics.topics.values()]" > data/topics.jsonl
    python -m zoo.prepare text --input=data/topics.jsonl --output=data/topics_bpe \
        --tokenizer=data/stdlib_bpe/tokenizer.json --val_fraction=0.1
    python -m zoo.main --config=experiments/bpe_lm.py:mixture --workdir=runs/bpe_mix

`:gpt2` trains the same model in GPT-2's layout (biases, tied embeddings, LayerNorm epsilon
1e-5), which `python -m zoo.convert export` hands to transformers as a GPT2LMHeadModel (see
experiments/finetune_lm.py); `:llama` in Llama's (rotary positions, RMSNorm, SwiGLU of the
same parameter count, 4 key/value heads for 8 query heads, no biases), a LlamaForCausalLM
(see experiments/finetune_chat.py).

Expect: 1.64 validation bits per byte (5.81 bits per token) after 600 steps on packed
documents (1.63 with `--config.data.windows=stream`), and `numpy_line_order` rising from
78% at step 100 to 87.5% (chance 25%); about 11 minutes on a 2-core CPU (one device, whole
command; the README's results tables have the byte-level model on the same files, and the
mixture's per-source numbers). `:smoke`: seconds, on any token
dataset given as --config.data.path.
"""
from ml_collections.config_dict import placeholder

from zoo.run.config import base_config, model_config


def get_config(arg=None):
  variants = set(arg.split(',')) if arg else set()
  if variants - {'smoke', 'gpt2', 'llama', 'mixture'} or {'gpt2', 'llama'} <= variants:
    raise ValueError(f'unknown variant {arg!r} of bpe_lm; known: smoke, gpt2 or llama, mixture '
                     '(e.g. smoke,gpt2)')
  c = base_config()
  # Every transformer_lm field is a key (model_config): a command line sets any of them.
  c.model = model_config(
      'transformer_lm',
      num_layers=4,
      d_model=128,
      num_heads=8,               # Split over the 'model' mesh axis: up to 8 ways.
      mlp_dim=512,
      max_len=128,
      positions='learned',
      scan_layers=False,
      remat='none',
      dtype='float32',
      dropout_rate=0.0,
      vocab_size=placeholder(int))  # None: the tokenizer's; larger pads the vocabulary.
  c.data.name = 'tokens'
  c.data.path = 'data/stdlib_bpe'  # Written by the prepare command above.
  c.data.seq_len = 128           # Tokens: about 470 bytes of source.
  c.train.steps = 600
  c.train.batch_size = 32
  c.train.log_every_steps = 50
  c.optimizer.learning_rate = 3e-3
  c.optimizer.warmup_steps = 50
  c.optimizer.weight_decay = 0.1
  c.optimizer.b2 = 0.99
  c.eval.every_steps = 100          # The multiple-choice task's rise, every 100 steps.
  c.eval.batch_size = 64
  c.eval.max_batches = 0         # The whole validation split.
  c.eval.sample_temperature = 0.8
  c.eval.choice_tasks = ('numpy_line_order',)  # NumPy's real line among 3 word shuffles.
  c.checkpoint.every_steps = 200
  if 'mixture' in variants:  # Code and prose, each evaluated on its own.
    c.data.path = ''
    c.data.sources = {'code': 'data/stdlib_bpe', 'docs': 'data/topics_bpe'}
    c.data.weights = {'code': 0.8, 'docs': 0.2}
  if 'gpt2' in variants:  # GPT-2's layout: zoo.convert exports it for transformers.
    c.model.update(use_bias=True, tie_embeddings=True, norm_epsilon=1e-5)
  if 'llama' in variants:  # Llama's layout: likewise.
    c.model.update(positions='rotary', norm='rms', mlp_activation='swiglu', num_kv_heads=4,
                   mlp_dim=352, norm_epsilon=1e-5)
  if 'smoke' in variants:
    c.model.update(num_layers=2, d_model=64, mlp_dim=128 if 'llama' not in variants else 88,
                   max_len=32)
    c.data.seq_len = 32
    c.train.update(steps=40, batch_size=16, log_every_steps=10)
    c.optimizer.warmup_steps = 5
    c.eval.update(every_steps=40, batch_size=16, max_batches=2, choice_tasks=())
    c.checkpoint.every_steps = 40
  return c
