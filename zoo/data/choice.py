"""Multiple-choice tasks evaluated in the training loop (`eval.choice_tasks`).

A task is a JSON Lines file, one item per line:

    {"context": "for i in range(n):\n", "choices": ["    total += i", "import os"], "answer": 0}

Each choice is scored by its log-likelihood given the context, as lm-evaluation-harness
scores `multiple_choice` tasks: the row is the context and the choice tokenized together
(the choice's tokens are those after the context's own; a context's trailing whitespace
moves to the choice), after the end-of-document token that starts every document, the context
cut from the left to fit `data.seq_len`. Metrics, at every eval: `acc` (the answer has the
highest log-likelihood) and `acc_norm` (the highest per UTF-8 byte of the choice, the
harness's length normalisation), as `eval/<task>/acc` and `eval/<task>/acc_norm`.

Shipped, by name: `numpy_line_order` (BUILTIN): 200 items whose context is four lines of
NumPy's Python source and whose choices are the line after them and three shuffles of its
words: which is the real line (chance 25%)? Offline (NumPy is installed with JAX), and
code none of the experiments trains on (bpe_lm's corpus is the standard library). Made by
`make_line_order_items` over NumPy 2.4.6's `.py` files, tests left out, seed 0. (Picking
the real next line among lines of other files stayed at chance for bpe_lm's small model
through its 600 steps: the summed log-likelihood favours the common lines of other files
over the specific one; word order is what a model of this size learns.)
"""
import dataclasses
import os
from typing import Callable, Iterable, Optional

from absl import logging
import numpy as np

from zoo.data import documents
from zoo.errors import ConfigError

BUILTIN = {'numpy_line_order': os.path.join(os.path.dirname(__file__), 'tasks',
                                            'numpy_line_order.jsonl')}
MAX_ITEMS = 100_000


@dataclasses.dataclass(frozen=True)
class ChoiceTask:
  """A task's rows, one per (item, choice): `rows` holds inputs, targets and mask [R, L]
  (mask 1 on the choice's tokens); `item` [R] and `choice_bytes` [R] say whose they are."""
  name: str
  rows: dict
  item: np.ndarray
  choice_bytes: np.ndarray
  answers: np.ndarray


def path_of(spec: str) -> str:
  return BUILTIN.get(spec, spec)


def name_of(spec: str) -> str:
  return spec if spec in BUILTIN else os.path.splitext(os.path.basename(spec))[0]


def read_items(path: str, field: str = 'config.eval.choice_tasks') -> list[dict]:
  """The items of a JSON Lines task file, each checked; ConfigError naming file and line."""
  if not os.path.isfile(path):
    raise ConfigError(f'{field}: {path} is not a file; give a JSON Lines task file or one of '
                      f'{", ".join(BUILTIN)}')
  items = []
  for number, item in documents.json_records(path, field):
    if not (isinstance(item, dict) and isinstance(item.get('context'), str)
            and isinstance(item.get('choices'), list) and len(item['choices']) >= 2
            and all(isinstance(c, str) and c for c in item['choices'])
            and isinstance(item.get('answer'), int) and not isinstance(item['answer'], bool)
            and 0 <= item['answer'] < len(item['choices'])):
      raise ConfigError(f'{field}: {path} line {number}: expected {{"context": str, "choices": '
                        '[at least 2 non-empty str], "answer": index of a choice}')
    items.append(item)
    if len(items) > MAX_ITEMS:
      raise ConfigError(f'{field}: {path} has more than {MAX_ITEMS:,} items; evaluate a '
                        'sample of it in the loop, the whole with zoo.evaluate')
  if not items:
    raise ConfigError(f'{field}: {path} has no items')
  return items


def split_pair(context: str, continuation: str) -> tuple[str, str]:
  """A context's trailing whitespace moved onto its continuation (lm-evaluation-harness's
  rule: tokenizers attach a space to the word after it)."""
  stripped = context.rstrip()
  return stripped, context[len(stripped):] + continuation


def encode_pair(encode: Callable[[str], np.ndarray], context: str,
                continuation: str) -> tuple[np.ndarray, np.ndarray]:
  """(context tokens, continuation tokens): the pair encoded whole, split after the
  context's own tokens, as lm-evaluation-harness does."""
  context, continuation = split_pair(context, continuation)
  whole = np.asarray(encode(context + continuation), np.int32)
  head = np.asarray(encode(context), np.int32) if context else np.zeros(0, np.int32)
  return whole[:len(head)], whole[len(head):]


def load(spec: str, encode: Callable[[str], np.ndarray], seq_len: int,
         eos: Optional[int]) -> ChoiceTask:
  """The task `spec` (a BUILTIN name or a file) as rows of seq_len tokens. Items with a
  choice longer than seq_len tokens are left out (logged); none left is a ConfigError."""
  start = np.asarray([eos] if eos is not None and eos >= 0 else [], np.int32)
  kept, pairs, items = [], [], read_items(path_of(spec))
  for item in items:
    encoded = [encode_pair(encode, item['context'], c) for c in item['choices']]
    if all(0 < len(continuation) <= seq_len for _, continuation in encoded):
      kept.append(item)
      pairs.extend(encoded)
  if len(kept) < len(items):
    logging.warning('%s: %d of %d items have a choice of no tokens or more than data.seq_len=%d: '
                    'left out', spec, len(items) - len(kept), len(items), seq_len)
  if not kept:
    raise ConfigError(f'config.eval.choice_tasks: no item of {spec} fits data.seq_len={seq_len}; '
                      'raise data.seq_len or give shorter choices')
  rows = {k: np.zeros((len(pairs), seq_len), np.int32) for k in ('inputs', 'targets')}
  rows['mask'] = np.zeros(rows['inputs'].shape, np.float32)
  for r, (context, continuation) in enumerate(pairs):
    tokens = np.concatenate([start, context, continuation])[-(seq_len + 1):]  # Context cut left.
    length = len(tokens) - 1
    rows['inputs'][r, :length] = tokens[:-1]
    rows['targets'][r, :length] = tokens[1:]
    rows['mask'][r, length - len(continuation):length] = 1.0
  item_of = [i for i, item in enumerate(kept) for _ in item['choices']]
  nbytes = [len(c.encode('utf-8')) for item in kept for c in item['choices']]
  return ChoiceTask(name_of(spec), rows, np.array(item_of), np.array(nbytes, np.float64),
                    np.array([item['answer'] for item in kept]))


def batches(task: ChoiceTask, global_batch_size: int, rows: slice) -> Iterable[dict]:
  """The task's rows in global batches (this process's `rows` of each), the last padded."""
  total = len(task.item)
  for start in range(0, total, global_batch_size):
    idx = np.arange(start, start + global_batch_size)[rows]
    idx = np.where(idx < total, idx, 0)
    yield {k: v[idx] for k, v in task.rows.items()}


def metrics(task: ChoiceTask, logliks: np.ndarray) -> dict:
  """acc and acc_norm from every row's log-likelihood (padding rows past the end ignored)."""
  logliks = np.asarray(logliks, np.float64)[:len(task.item)]
  acc, acc_norm = [], []
  for index, answer in enumerate(task.answers.tolist()):
    mine = task.item == index
    acc.append(np.argmax(logliks[mine]) == answer)
    acc_norm.append(np.argmax(logliks[mine] / task.choice_bytes[mine]) == answer)
  return {f'eval/{task.name}/acc': float(np.mean(acc)),
          f'eval/{task.name}/acc_norm': float(np.mean(acc_norm))}


def make_line_order_items(files: list[str], count: int, seed: int = 0, context_lines: int = 4,
                          num_choices: int = 4) -> list[dict]:
  """Items whose context is `context_lines` consecutive non-blank lines of a source file and
  whose choices are the line after them and num_choices - 1 shuffles of its words (its
  indentation kept): which is the real line? Lines that are blank, comment-only, shorter
  than 12 characters or of fewer than 4 words are never asked about."""
  rng = np.random.default_rng(seed)
  pools = []
  for path in files:
    with open(path, encoding='utf-8') as f:
      pools.append(f.read().splitlines())
  candidates = [(f, i) for f, lines in enumerate(pools) for i in range(context_lines, len(lines))
                if _choosable(lines[i]) and all(s.strip() for s in lines[i - context_lines:i])]
  items = []
  for f, i in (candidates[j] for j in rng.permutation(len(candidates))):
    line = pools[f][i]
    words, indent = line.split(), line[:len(line) - len(line.lstrip())]
    real = indent + ' '.join(words)
    shuffles = set()
    for _ in range(20):
      order = rng.permutation(len(words))
      shuffled = indent + ' '.join(words[k] for k in order)
      if shuffled != real:
        shuffles.add(shuffled)
      if len(shuffles) == num_choices - 1:
        break
    if len(words) < 4 or len(shuffles) < num_choices - 1:
      continue
    answer, others = int(rng.integers(num_choices)), sorted(shuffles)
    items.append({'context': '\n'.join(pools[f][i - context_lines:i]) + '\n',
                  'choices': others[:answer] + [real] + others[answer:], 'answer': answer})
    if len(items) == count:
      break
  return items


def _choosable(line: str) -> bool:
  text = line.strip()
  return len(text) >= 12 and not text.startswith('#')
