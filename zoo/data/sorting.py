"""Sorting digits: a generated task whose answers can be checked, for post-training on 2 cores
(experiments/sort_lm.py, dpo_lm.py). No download: the same seed writes the same files.

A prompt is `sort 3 1 4 1 5 9:` (3 to 6 digits); the answer is the digits sorted, ` 1 1 3 4 5
9`. `write(directory)` makes
- `sft.jsonl`: {"text": prompt + answer} documents, to pre-train a model on the task
  (zoo.prepare text --tokenizer=bytes);
- `pairs.jsonl`: {"prompt", "chosen", "rejected"} preference pairs (zoo.prepare
  preference): the chosen is the answer; the rejected a near miss, the answer with two
  neighbouring digits swapped or one digit changed, so that a model must read the digits
  to tell them apart;
- `prompts.jsonl`: {"prompt", "answer"} prompts and their answers, for reinforcement
  learning (zoo.prepare prompts; the rewards `exact` and `digits` below read "answer").
The three use disjoint prompts (each multiset of digits in one file only).
"""
import json
import os
import zlib

import numpy as np


def prompt(digits) -> str:
  return 'sort ' + ' '.join(str(d) for d in digits) + ':'


def answer(digits) -> str:
  return ' ' + ' '.join(str(d) for d in sorted(digits))


def _near_miss(digits, rng) -> str:
  """The answer with one mistake: two unequal neighbours swapped, else one digit changed."""
  out = sorted(digits)
  pairs = [i for i in range(len(out) - 1) if out[i] != out[i + 1]]
  if pairs and rng.random() < 0.5:
    i = pairs[rng.integers(len(pairs))]
    out[i], out[i + 1] = out[i + 1], out[i]
  else:
    i = int(rng.integers(len(out)))
    out[i] = (out[i] + int(rng.integers(1, 10))) % 10
  return ' ' + ' '.join(str(d) for d in out)


def write(directory: str, sft: int = 4000, pairs: int = 2000, prompts: int = 500,
          seed: int = 0) -> None:
  """Writes sft.jsonl, pairs.jsonl and prompts.jsonl (see the module docstring)."""
  rng = np.random.default_rng(seed)
  seen, rows = set(), []
  while len(rows) < sft + pairs + prompts:
    digits = [int(d) for d in rng.integers(0, 10, size=int(rng.integers(3, 7)))]
    key = tuple(sorted(digits))
    if key not in seen:
      seen.add(key)
      rows.append(digits)
  os.makedirs(directory, exist_ok=True)
  files = {'sft.jsonl': [{'text': prompt(d) + answer(d)} for d in rows[:sft]],
           'pairs.jsonl': [{'prompt': prompt(d), 'chosen': answer(d),
                            'rejected': _near_miss(d, rng)} for d in rows[sft:sft + pairs]],
           'prompts.jsonl': [{'prompt': prompt(d), 'answer': answer(d)}
                             for d in rows[sft + pairs:]]}
  for name, records in files.items():
    with open(os.path.join(directory, name), 'w', encoding='utf-8') as f:
      f.writelines(json.dumps(r) + '\n' for r in records)


# Rewards (zoo.data.rewards): `grpo.rewards = ('zoo.data.sorting:exact',)`.
def exact(completions, answer, **unused) -> list[float]:
  """1 if the completion is the sorted digits (spaces around them aside), else 0."""
  del unused
  return [float(c.split() == a.split()) for c, a in zip(completions, answer)]


def digits(completions, answer, **unused) -> list[float]:
  """The fraction of the answer's digits in place (partial credit; 0 for a wrong count)."""
  del unused
  out = []
  for c, a in zip(completions, answer):
    got, want = c.split(), a.split()
    out.append(sum(g == w for g, w in zip(got, want)) / len(want) if len(got) == len(want) else 0.0)
  return out


def shuffled_exact(prompts, completions, answer, **unused) -> list[float]:
  """`exact`'s rewards shuffled among the batch's completions (the same on every process:
  seeded by the prompts): rewards unrelated to what each completion is, GRPO's control that
  must not improve."""
  del unused
  values = exact(completions, answer)
  order = np.random.default_rng(zlib.crc32('\n'.join(prompts).encode())).permutation(len(values))
  return [values[i] for i in order]
