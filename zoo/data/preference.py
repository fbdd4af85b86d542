"""Preference pairs for DPO: a prompt and two completions of it, the chosen and the rejected.

Input (what `python -m zoo.prepare preference` reads): JSON Lines in TRL's two formats,
- standard: `{"prompt": "...", "chosen": "...", "rejected": "..."}`, the prompt started as
  the model's documents were in training (tokenizer.document_start), the completions each
  followed by the tokenizer's end-of-sequence token (so the model learns to stop);
- conversational: `{"prompt": [messages], "chosen": [messages], "rejected": [messages]}`,
  the prompt rendered with the model's chat template and its generation prompt, each
  completion as what the template adds for the prompt's messages followed by the
  completion's (the assistant's turn and how the template closes it).
Prompt and completion are tokenized apart (the same prompt ids for both completions) with
the model's tokenizer (`--tokenizer`: its directory, a zoo workdir, or a tokenizer.json).

On disk: `train.npz` and `val.npz` (ids of every sequence end to end, each pair's starts,
lengths and prompt length) and metadata.json, last. Training (`data.name='preference'`)
cuts each sequence to `data.seq_len` + 1 tokens (keeping its start: a completion's end is
cut, as TRL's default), or to the longest pair's length if that is shorter, into `inputs`,
`targets` and `mask` [B, 2, L] (mask 1 on the
completion's targets) and adds `reference` [B, 2], each completion's log-probability under
the reference model: NaN until a run computes them (zoo.run.reference).
"""
import os
from typing import Any

from absl import logging
import ml_collections
import numpy as np

from zoo.data import chat, documents, tokenizer as tokenizer_lib
from zoo.data.dataset import (DataSource, Dataset, Reference, epoch_order, finish,
                              padded_batches, read_arrays, read_metadata, write_arrays)
from zoo.errors import ConfigError, fail
from zoo.store import storage

FORMAT, VERSION = 'preference', 1
SPLITS = ('train', 'val')
FIELDS = ('prompt', 'chosen', 'rejected')


def _text_pair(record: dict, where: str, eos: list) -> tuple[str, list]:
  for key in FIELDS:
    if not isinstance(record.get(key), str):
      raise ConfigError(f'{where}: "{key}" must be a string (standard format) or a list of '
                        'messages (conversational), as in {"prompt": ..., "chosen": ..., '
                        '"rejected": ...}')
  return record['prompt'], [(record['chosen'], eos), (record['rejected'], eos)]


def _chat_pair(record: dict, where: str, renderer: Any) -> tuple[str, list]:
  for key in FIELDS[1:]:
    if not isinstance(record[key], list) or not record[key]:
      raise ConfigError(f'{where}: "{key}" must be a non-empty list of messages')
  prompt = record['prompt']
  if not isinstance(prompt, list) or not all(isinstance(m, dict) for m in prompt):
    raise ConfigError(f'{where}: "prompt" must be a list of messages like "chosen"')
  head, _ = renderer.render(prompt, add_generation_prompt=True)
  completions = []
  for key in FIELDS[1:]:
    whole, _ = renderer.render(prompt + record[key])
    if not whole.startswith(head):
      raise ConfigError(f'{where}: the chat template renders the prompt differently once '
                        f'"{key}" follows it, so the completion cannot be cut from it; give the '
                        'pair in the standard format (text)')
    completions.append((whole[len(head):], []))
  return head, completions


def prepare(files: list[str], directory: str, tokenizer_spec: str, *, val_fraction: float,
            seed: int, chat_template: str = '') -> dict:
  """Writes the pairs of `files` (JSON Lines) into `directory`; returns the metadata.
  ConfigError naming the file and line of a pair with a missing field or an empty
  completion."""
  from zoo.data import tokens  # pylint: disable=import-outside-toplevel
  path = tokenizer_lib.resolve(tokenizer_spec)
  tokenizer = tokenizer_lib.load(path, '--tokenizer', 'give the model\'s directory, its zoo '
                                 'workdir or its tokenizer.json')
  eos, start_ids = tokenizer_lib.eos_id(tokenizer), tokenizer_lib.document_start(tokenizer)
  renderer = None
  out = {s: {'ids': [], 'pairs': []} for s in SPLITS}
  offsets = {s: 0 for s in SPLITS}
  index = 0
  for file in files:
    for number, record in documents.json_records(file):
      where = f'--input: {file} line {number}'
      if not isinstance(record, dict) or any(k not in record for k in FIELDS):
        got = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ConfigError(f'{where}: a pair needs "prompt", "chosen" and "rejected"; got {got}')
      if isinstance(record['chosen'], list):
        if renderer is None:
          directory_ = tokenizer_spec if os.path.isdir(tokenizer_spec) else os.path.dirname(path)
          renderer = chat.Renderer(chat.load_template(directory_, chat_template))
        prompt, completions = _chat_pair(record, where, renderer)
      else:
        prompt, completions = _text_pair(record, where, [eos] if eos >= 0 else [])
      start = [] if isinstance(record['chosen'], list) else start_ids  # Templates write theirs.
      prompt_ids = start + tokenizer.encode(prompt, add_special_tokens=False).ids
      split = 'val' if tokens.in_validation(index, val_fraction, seed) else 'train'
      index += 1
      entry = []
      for key, (text, end) in zip(FIELDS[1:], completions):
        ids = tokenizer.encode(text, add_special_tokens=False).ids + end
        if not text.strip() or not ids:
          raise ConfigError(f'{where}: "{key}" is an empty completion; give it text or leave '
                            'the pair out')
        out[split]['ids'].append(np.asarray(prompt_ids + ids, np.int32))
        entry += [offsets[split], len(prompt_ids) + len(ids)]
        offsets[split] += len(prompt_ids) + len(ids)
      out[split]['pairs'].append(entry + [len(prompt_ids)])
  meta = {'format': FORMAT, 'version': VERSION, 'vocab_size': tokenizer_lib.vocab_size(tokenizer),
          'splits': {}}
  for split in SPLITS:
    if not out[split]['pairs']:
      raise ConfigError(f'--input: no pair went to the {split} split ({index} pairs at '
                        '--val_fraction); give more pairs or change --val_fraction')
    pairs = np.asarray(out[split]['pairs'], np.int64)
    write_arrays(directory, split, ids=np.concatenate(out[split]['ids']), starts=pairs[:, [0, 2]],
                 lengths=pairs[:, [1, 3]], prompt=pairs[:, 4])
    meta['splits'][split] = {'pairs': len(pairs), 'tokens': int(offsets[split]),
                             'longest': int(pairs[:, [1, 3]].max())}
  return finish(directory, tokenizer, meta)


def describe(meta: dict) -> str:
  return ', '.join(f'{name}: {s["pairs"]:,} pairs, {s["tokens"]:,} tokens, longest {s["longest"]}'
                   for name, s in meta['splits'].items())


def _windows(arrays: dict, seq_len: int) -> tuple[np.ndarray, np.ndarray, int]:
  """(tokens [N, 2, seq_len + 1], target mask [N, 2, seq_len], pairs cut short)."""
  ids, starts, lengths, prompt = (arrays[k] for k in ('ids', 'starts', 'lengths', 'prompt'))
  window = seq_len + 1
  kept = np.minimum(lengths, window)
  at = np.arange(window)
  valid = at < kept[..., None]                                       # [N, 2, window]
  tokens = np.where(valid, ids[np.minimum(starts[..., None] + at, len(ids) - 1)], 0)
  # Target t is token t + 1: a completion's if t + 1 >= the prompt's length.
  mask = valid[..., 1:] & (at[1:] >= prompt[:, None, None])
  return tokens.astype(np.int32), mask.astype(np.uint8), int((lengths > window).any(-1).sum())


def load(data_config: ml_collections.ConfigDict, seed: int) -> Dataset:
  path = data_config.path
  meta = read_metadata(path, FORMAT, (VERSION,), 'preference')
  tokenizer = tokenizer_lib.load(storage.join(path, 'tokenizer.json'), 'config.data.path')
  # Windows no longer than the longest pair needs: a larger seq_len pads nothing.
  seq_len = min(data_config.seq_len, max(s['longest'] for s in meta['splits'].values()) - 1)
  splits = {}
  for split in SPLITS:
    tokens, mask, cut = _windows(read_arrays(path, split), seq_len)
    if cut:
      logging.warning('%s: %d of %d %s pairs are longer than data.seq_len + 1 = %d tokens: '
                      'their completions are cut', path, cut, len(tokens), split,
                      data_config.seq_len + 1)
    if not (room := mask.any(-1).all(-1)).all():
      fail('data.seq_len', f'{data_config.seq_len}: the prompts of {int((~room).sum())} {split} '
           f'pairs of {path} leave no room for a completion; raise data.seq_len')
    splits[split] = {'inputs': tokens[..., :-1], 'targets': tokens[..., 1:], 'mask': mask}
  reference = Reference({s: np.full((len(splits[s]['mask']), 2), np.nan, np.float32)
                         for s in SPLITS},
                        {s: (lambda size, rows, s=s: padded_batches(splits[s], size, rows))
                         for s in SPLITS})
  train = splits['train']

  def train_batch(step, global_batch_size, rows):
    idx = epoch_order(seed, len(train['mask']), step, global_batch_size)[rows]
    return {**{k: v[idx] for k, v in train.items()},
            'reference': reference.tables['train'][idx]}

  def eval_batches(global_batch_size, rows):
    return padded_batches({**splits['val'], 'reference': reference.tables['val']},
                          global_batch_size, rows)

  decode, encode = tokenizer_lib.codec(tokenizer)
  return Dataset(task='dpo', model_fields={'vocab_size': meta['vocab_size']},
                 train_batch=train_batch, eval_batches=eval_batches,
                 num_train=len(train['mask']), token_unit='token', decode=decode, encode=encode,
                 eos_id=tokenizer_lib.eos_id(tokenizer), reference=reference)


def check_config(data_config: ml_collections.ConfigDict) -> None:
  if not data_config.get('path'):
    fail('data.path', 'give the directory that `python -m zoo.prepare preference` wrote')
  if data_config.get('seq_len', 0) <= 0:
    fail('data.seq_len', f'must be positive, got {data_config.get("seq_len")}')
  if not storage.is_remote(data_config.path) and not os.path.isdir(data_config.path):
    fail('data.path', f'{data_config.path} is not a directory; give the directory that '
         '`python -m zoo.prepare preference` wrote')


SOURCE = DataSource(load, task='dpo', check_config=check_config)
