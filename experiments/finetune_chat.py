r"""Chat fine-tuning (SFT) of an imported model: conversations rendered with the model's own
chat template, the loss on the assistant's tokens only, a reply sampled at each eval.

    python -m zoo.convert import --hf_dir=path/to/hf_model --workdir=runs/imported
    python -m zoo.prepare chat --input=conversations.jsonl --output=data/chat \
        --tokenizer=runs/imported
    python -m zoo.main --config=experiments/finetune_chat.py:runs/imported --workdir=runs/chat \
        --config.data.path=data/chat
    python -m zoo.convert export --workdir=runs/chat --hf_dir=out/chat

Conversations are JSON Lines of {"messages": [{"role": ..., "content": ...}, ...]} (zoo.data
.chat); each is a packed document whose targets count only on the assistant's turns (the
mean over those tokens, across microbatches and devices). Eval reports the held-out
conversations' loss on the same tokens and logs the reply to the first one's opening.
`,lora` trains rank-8 adapters only; `zoo.convert export` merges them, `--peft` writes a
PEFT adapter directory. `get_config('IMPORTED_WORKDIR[,smoke][,lora]')`; `:smoke`: seconds.

The README's run (docs/pretrained.md, 'Chat fine-tuning'): a Llama-layout model pre-trained
by zoo on the standard library's code, exported and imported like any Hugging Face
checkpoint, then taught to answer questions about the standard library in a plain
question/answer template (its tokenizer has no chat tokens), on 522 conversations made from
the library's docstrings (zoo.data.docstring_chat):

    python -m zoo.main --config=experiments/bpe_lm.py:llama --workdir=runs/bpe_llama
    python -m zoo.convert export --workdir=runs/bpe_llama --hf_dir=runs/bpe_llama_hf
    python -m zoo.convert import --hf_dir=runs/bpe_llama_hf --workdir=runs/llama_imported
    python -c "from zoo.data import docstring_chat; docstring_chat.write('data/chat.jsonl')"
    python -m zoo.prepare chat --input=data/chat.jsonl --output=data/chat \
        --tokenizer=runs/llama_imported --val_fraction=0.05 \
        --chat_template=zoo/data/templates/question_answer.jinja
    python -m zoo.main --config=experiments/finetune_chat.py:runs/llama_imported \
        --workdir=runs/chat --config.data.path=data/chat

Expect, on a 2-core CPU: about 6 minutes; the held-out answers from 1.83 bits per byte (the
import) to 1.40; a greedy reply in the answers' form ("Return the object ..."). `,lora`:
about 6 minutes, 1.59 bits per byte, 0.57 MiB of optimizer state against 21.6 MiB.
"""
from zoo.run.config import imported_model


def get_config(arg=None):
  workdir, *variants = (arg or '').split(',')
  if not workdir or set(variants) - {'smoke', 'lora'}:
    raise ValueError(f'finetune_chat needs the imported workdir: --config=experiments/'
                     f'finetune_chat.py:WORKDIR[,smoke][,lora], got {arg!r}; known variants: '
                     'smoke, lora')
  c = imported_model(workdir, 'finetune_chat', lora_rank=8 if 'lora' in variants else 0)
  c.data.seq_len = min(256, c.model.max_len)  # Whole conversations, packed.
  c.train.steps = 300
  c.train.batch_size = 32
  c.train.log_every_steps = 25
  c.optimizer.learning_rate = 1e-3 if 'lora' in variants else 3e-4
  c.optimizer.warmup_steps = 30
  c.optimizer.weight_decay = 0.0
  c.optimizer.b2 = 0.99
  c.eval.every_steps = 50
  c.eval.batch_size = 32
  c.eval.max_batches = 0
  c.eval.sample_temperature = 0.0   # The greedy reply: comparable from eval to eval.
  c.checkpoint.every_steps = 100
  if 'smoke' in variants:
    c.data.seq_len = min(64, c.model.max_len)
    c.train.update(steps=12, batch_size=16, log_every_steps=4)
    c.optimizer.update(learning_rate=3e-3, warmup_steps=2)
    c.eval.update(every_steps=6, batch_size=16, max_batches=2)
    c.checkpoint.every_steps = 6
  return c
