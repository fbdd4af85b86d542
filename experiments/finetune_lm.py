r"""Fine-tune an imported language model on a token dataset made with its own tokenizer.

    python -m zoo.convert import --hf_dir=path/to/hf_model --workdir=runs/imported
    python -m zoo.prepare text --input=docs.jsonl --output=data/ft \
        --tokenizer=runs/imported/tokenizer.json
    python -m zoo.main --config=experiments/finetune_lm.py:runs/imported --workdir=runs/ft \
        --config.data.path=data/ft
    python -m zoo.convert export --workdir=runs/ft --hf_dir=out/ft

`get_config('IMPORTED_WORKDIR[,smoke][,lora]')`: the model is the imported one (its
config.json's fields), its params start from the import's checkpoint (`checkpoint.init_from`),
and the optimizer, schedule and step count are fresh; any mesh works, the rules replicating
what the model's sizes do not split. `model.lora.rank` > 0 (`,lora`: rank 8 on every
projection) trains low-rank adapters only, the imported weights frozen (zoo.models.lora);
export merges them (`zoo.convert export`) or writes them as a PEFT adapter (`--peft`).
The README's results table has a full run: a GPT-2-layout model trained by `bpe_lm:gpt2`,
exported, imported and fine-tuned on the Python docs.
`:smoke` (after the workdir): seconds.
"""
from zoo.run.config import imported_model


def get_config(arg=None):
  workdir, *variants = (arg or '').split(',')
  if not workdir or set(variants) - {'smoke', 'lora'}:
    raise ValueError(f'finetune_lm needs the imported workdir: --config=experiments/'
                     f'finetune_lm.py:WORKDIR[,smoke][,lora], got {arg!r}; known variants: '
                     'smoke, lora')
  c = imported_model(workdir, 'finetune_lm', lora_rank=8 if 'lora' in variants else 0)
  c.train.steps = 300
  c.train.batch_size = 32
  c.train.log_every_steps = 50
  c.optimizer.learning_rate = 3e-4    # Lower than from scratch: keep what was learned.
  c.optimizer.warmup_steps = 30
  c.optimizer.weight_decay = 0.1
  c.optimizer.b2 = 0.99
  c.eval.every_steps = 100
  c.eval.batch_size = 32
  c.eval.max_batches = 0
  c.checkpoint.every_steps = 100
  if 'lora' in variants:
    c.optimizer.learning_rate = 1e-3  # Adapters start at zero: a higher rate than full tuning.
  if 'smoke' in variants:
    c.data.seq_len = min(32, c.model.max_len)
    c.train.update(steps=20, batch_size=16, log_every_steps=5)
    c.optimizer.update(learning_rate=3e-3, warmup_steps=2)
    c.eval.update(every_steps=20, batch_size=16, max_batches=2)
    c.checkpoint.every_steps = 10
  return c
