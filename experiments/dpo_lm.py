r"""Direct preference optimisation (DPO) of a language model that zoo trained or imported,
on pairs of completions prepared with its tokenizer.

    python -m zoo.convert import --hf_dir=path/to/hf_model --workdir=runs/imported
    python -m zoo.prepare preference --input=pairs.jsonl --output=data/pairs \
        --tokenizer=runs/imported
    python -m zoo.main --config=experiments/dpo_lm.py:runs/imported --workdir=runs/dpo \
        --config.data.path=data/pairs

Pairs are JSON Lines in TRL's standard ({"prompt": "...", "chosen": "...", "rejected": "..."})
or conversational format (lists of messages, rendered with the model's chat template):
zoo.data.preference. The policy starts from the workdir's parameters
(`checkpoint.init_from`), and so does the frozen reference: every pair's reference
log-probabilities are computed once, before the first step (zoo.run.reference). The loss
(zoo.run.tasks.Preference) is `dpo.loss` ('sigmoid', with `dpo.label_smoothing` as cDPO, or
'ipo') at `dpo.beta`; training and eval log TRL's figures: rewards/chosen, rewards/rejected,
rewards/margins, rewards/accuracies, logps/chosen, logps/rejected. `,lora` trains rank-8
adapters only, and the reference is the base model itself (no second copy).
`get_config('WORKDIR[,smoke][,lora]')`; `:smoke`: seconds.

The README's run (docs/post_training.md): experiments/sort_lm.py's model, taught to sort
digits by a short pre-training, tuned on 1,783 pairs whose rejected completion is a near
miss (two digits swapped or one changed): held-out preference accuracy 0.90 at step 50 and
0.96 at step 200, the reward margin from 0 to 0.51, in 14 s on a 2-core CPU.

Defaults, and why: beta 0.1 as TRL and the DPO paper; the learning rate 1e-4 (LoRA 3e-4)
is larger than TRL's 1e-6 because the models this file tunes on 2 cores are small (at 1e-5
a sorting model's held-out margin moved a quarter as far in 200 steps); the loss is the
mean over pairs in float32 (TRL: bf16 by default, even on CPU).
"""
from zoo.run.config import imported_model


def get_config(arg=None):
  workdir, *variants = (arg or '').split(',')
  if not workdir or set(variants) - {'smoke', 'lora'}:
    raise ValueError(f'dpo_lm needs the workdir of the model to tune: --config=experiments/'
                     f'dpo_lm.py:WORKDIR[,smoke][,lora], got {arg!r}; known variants: '
                     'smoke, lora')
  c = imported_model(workdir, 'dpo_lm', lora_rank=8 if 'lora' in variants else 0)
  c.data.name = 'preference'
  c.data.seq_len = min(256, c.model.max_len)
  c.dpo.beta = 0.1
  c.dpo.loss = 'sigmoid'
  c.train.steps = 200
  c.train.batch_size = 32
  c.train.log_every_steps = 20
  c.optimizer.learning_rate = 3e-4 if 'lora' in variants else 1e-4
  c.optimizer.warmup_steps = 20
  c.optimizer.weight_decay = 0.0
  c.eval.every_steps = 50
  c.eval.batch_size = 32
  c.eval.max_batches = 0
  c.checkpoint.every_steps = 100
  if 'smoke' in variants:
    c.data.seq_len = min(48, c.model.max_len)
    c.train.update(steps=8, batch_size=8, log_every_steps=4)
    c.optimizer.update(learning_rate=1e-3, warmup_steps=2)
    c.eval.update(every_steps=4, batch_size=8, max_batches=2)
    c.checkpoint.every_steps = 4
  return c
