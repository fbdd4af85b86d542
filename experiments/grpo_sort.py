r"""GRPO on a verifiable task: experiments/sort_lm.py's model, taught to sort digits by a
short pre-training, learns from the rewards of its own completions (zoo.run.rollouts).

    python -c "from zoo.data import sorting; sorting.write('data/sort')"
    python -m zoo.prepare text --input=data/sort/sft.jsonl --output=data/sort_sft \
        --tokenizer=bytes --val_fraction=0.05
    python -m zoo.main --config=experiments/sort_lm.py --workdir=runs/sort
    python -m zoo.prepare prompts --input=data/sort/prompts.jsonl --output=data/sort_prompts \
        --tokenizer=runs/sort --val_fraction=0.3
    python -m zoo.main --config=experiments/grpo_sort.py:runs/sort --workdir=runs/sort_grpo \
        --config.data.path=data/sort_prompts

The reward is exact match (zoo.data.sorting:exact: 1 if the completion is the sorted
digits; the digits in place are logged beside it). Each step samples 8 completions of each
of 16 prompts at temperature 1; eval reports the held-out prompts' reward sampled at that
temperature and greedy (eval/sampled/exact, eval/greedy/exact). The README's run
(docs/post_training.md): sampled exact match on 147 held-out prompts from 0.306 to 0.884,
greedy from 0.633 to 0.918, in 3 min 44 s on a 2-core CPU; `,shuffled` ends at 0.218 and
0.531. `,shuffled` scores each completion against
another prompt's answer (zoo.data.sorting:shuffled_exact): the control that must not
improve. `,lora` trains rank-8 adapters only. `get_config('WORKDIR[,smoke][,shuffled]
[,lora]')`; `:smoke`: seconds.
"""
from zoo.run.config import imported_model

VARIANTS = {'smoke', 'shuffled', 'lora'}


def get_config(arg=None):
  workdir, *variants = (arg or '').split(',')
  if not workdir or set(variants) - VARIANTS:
    raise ValueError(f'grpo_sort needs the workdir of the model to tune: --config=experiments/'
                     f'grpo_sort.py:WORKDIR[,smoke][,shuffled][,lora], got {arg!r}; known '
                     'variants: smoke, shuffled, lora')
  c = imported_model(workdir, 'grpo_sort', lora_rank=8 if 'lora' in variants else 0)
  c.data.name = 'prompts'
  c.data.seq_len = 24                     # The longest prompt: 'sort 1 2 3 4 5 6:' in bytes.
  # Trained on exact match; the digits in place (partial credit) logged beside it (weight 0).
  c.grpo.rewards = ('zoo.data.sorting:shuffled_exact' if 'shuffled' in variants else
                    'zoo.data.sorting:exact', 'zoo.data.sorting:digits')
  c.grpo.reward_weights = (1.0, 0.0)
  c.grpo.num_generations = 8
  c.grpo.max_completion_tokens = 16       # ' 1 2 3 4 5 6' and the end token: 13.
  c.grpo.temperature = 1.0
  c.grpo.beta = 0.04
  c.train.steps = 1500
  c.train.batch_size = 128                # 16 prompts x 8 completions.
  c.train.log_every_steps = 20
  c.optimizer.learning_rate = 3e-3 if 'lora' in variants else 3e-4
  c.optimizer.warmup_steps = 10
  c.optimizer.weight_decay = 0.0
  c.eval.every_steps = 100
  c.eval.batch_size = 64
  c.eval.max_batches = 0
  c.checkpoint.every_steps = 250
  if 'smoke' in variants:
    c.train.update(steps=4, batch_size=16, log_every_steps=2)
    c.grpo.num_generations = 4
    c.eval.update(every_steps=2, batch_size=8, max_batches=1)
    c.checkpoint.every_steps = 2
  return c
