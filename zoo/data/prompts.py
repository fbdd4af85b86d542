"""Prompts for reinforcement learning (GRPO): what `python -m zoo.prepare prompts` writes and
`data.name='prompts'` reads.

Input: JSON Lines, one `{"prompt": ..., <any other fields>}` per line; the prompt is text, or
a list of messages rendered with the model's chat template and its generation prompt (TRL's
conversational format). A text prompt starts as the model's documents did in training
(tokenizer.document_start: its beginning-of-sequence token, else its end-of-document
token). The other fields (e.g. "answer") are handed to the reward functions by name, as
TRL hands a dataset's columns (zoo.data.rewards). Prompts are
tokenized with the model's tokenizer (`--tokenizer`: its directory, a zoo workdir, or a
tokenizer.json).

On disk: `train.npz` and `val.npz` (every prompt's ids end to end, their starts and
lengths), `train.jsonl` and `val.jsonl` (each prompt's other fields), the tokenizer, and
metadata.json last. Training batches are `prompt` [B, data.seq_len] int32, left-padded
with 0 (a longer prompt keeps its end, counted in a warning), `pad` [B] (the padding
before each prompt) and `index` [B] (the prompt's row in its split).
"""
import json
import os

from absl import logging
import ml_collections
import numpy as np

from zoo.data import chat, documents, tokenizer as tokenizer_lib
from zoo.data.dataset import (DataSource, Dataset, epoch_order, finish, padded_batches,
                              read_arrays, read_metadata, write_arrays)
from zoo.errors import ConfigError, fail
from zoo.store import storage

FORMAT, VERSION = 'prompts', 1
SPLITS = ('train', 'val')


def prepare(files: list[str], directory: str, tokenizer_spec: str, *, val_fraction: float,
            seed: int, chat_template: str = '') -> dict:
  """Writes the prompts of `files` into `directory`; returns the metadata. ConfigError
  naming the file and line of a record without a usable prompt."""
  from zoo.data import tokens  # pylint: disable=import-outside-toplevel
  path = tokenizer_lib.resolve(tokenizer_spec)
  tokenizer = tokenizer_lib.load(path, '--tokenizer', 'give the model\'s directory, its zoo '
                                 'workdir or its tokenizer.json')
  renderer, start_ids = None, tokenizer_lib.document_start(tokenizer)
  out = {s: {'ids': [], 'lengths': [], 'records': []} for s in SPLITS}
  index = 0
  for file in files:
    for number, record in documents.json_records(file):
      where = f'--input: {file} line {number}'
      prompt = record.get('prompt') if isinstance(record, dict) else None
      start = start_ids
      if isinstance(prompt, list):
        start = []  # The template writes its own beginning.
        if renderer is None:
          template_dir = tokenizer_spec if os.path.isdir(tokenizer_spec) else os.path.dirname(path)
          renderer = chat.Renderer(chat.load_template(template_dir, chat_template))
        if not all(isinstance(m, dict) for m in prompt):
          raise ConfigError(f'{where}: "prompt" must be text or a list of messages')
        prompt, _ = renderer.render(prompt, add_generation_prompt=True)
      if not isinstance(prompt, str) or not prompt:
        raise ConfigError(f'{where}: a record needs a non-empty "prompt" (text or a list of '
                          'messages), as in {"prompt": "...", "answer": "..."}')
      ids = start + tokenizer.encode(prompt, add_special_tokens=False).ids
      split = 'val' if tokens.in_validation(index, val_fraction, seed) else 'train'
      index += 1
      out[split]['ids'].append(np.asarray(ids, np.int32))
      out[split]['lengths'].append(len(ids))
      out[split]['records'].append({k: v for k, v in record.items() if k != 'prompt'})
  meta = {'format': FORMAT, 'version': VERSION, 'vocab_size': tokenizer_lib.vocab_size(tokenizer),
          'splits': {}}
  for split in SPLITS:
    if not out[split]['lengths']:
      raise ConfigError(f'--input: no prompt went to the {split} split ({index} prompts at '
                        '--val_fraction); give more prompts or change --val_fraction')
    lengths = np.asarray(out[split]['lengths'], np.int64)
    write_arrays(directory, split, ids=np.concatenate(out[split]['ids']),
                 starts=np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths=lengths)
    with open(os.path.join(directory, f'{split}.jsonl'), 'w', encoding='utf-8') as f:
      f.writelines(json.dumps(r) + '\n' for r in out[split]['records'])
    meta['splits'][split] = {'prompts': len(lengths), 'longest': int(lengths.max())}
  return finish(directory, tokenizer, meta)


def describe(meta: dict) -> str:
  return ', '.join(f'{name}: {s["prompts"]:,} prompts, longest {s["longest"]} tokens'
                   for name, s in meta['splits'].items())


def _left_padded(arrays: dict, length: int) -> tuple[np.ndarray, np.ndarray, int]:
  """(prompts [N, length] left-padded with 0, padding [N], prompts cut at the front)."""
  ids, starts, lengths = arrays['ids'], arrays['starts'], arrays['lengths']
  kept = np.minimum(lengths, length)
  pad = length - kept
  at = np.arange(length)[None, :] - pad[:, None]                    # Index into the kept end.
  source = starts[:, None] + (lengths - kept)[:, None] + np.maximum(at, 0)
  prompts = np.where(at >= 0, ids[np.minimum(source, len(ids) - 1)], 0)
  return prompts.astype(np.int32), pad.astype(np.int32), int((lengths > length).sum())


def load(data_config: ml_collections.ConfigDict, seed: int) -> Dataset:
  path = data_config.path
  meta = read_metadata(path, FORMAT, (VERSION,), 'prompts')
  tokenizer = tokenizer_lib.load(storage.join(path, 'tokenizer.json'), 'config.data.path')
  length = min(data_config.seq_len, max(s['longest'] for s in meta['splits'].values()))
  splits, records = {}, {}
  for split in SPLITS:
    prompts, pad, cut = _left_padded(read_arrays(path, split), length)
    if cut:
      logging.warning('%s: %d of %d %s prompts are longer than data.seq_len = %d tokens: their '
                      'beginnings are cut', path, cut, len(prompts), split, length)
    splits[split] = {'prompt': prompts, 'pad': pad,
                     'index': np.arange(len(prompts), dtype=np.int32)}
    records[split] = [json.loads(line) for line in
                      storage.read_text(storage.join(path, f'{split}.jsonl')).splitlines()]
  train = splits['train']

  def train_batch(step, global_batch_size, rows):
    idx = epoch_order(seed, len(train['pad']), step, global_batch_size)[rows]
    return {k: v[idx] for k, v in train.items()}

  def eval_batches(global_batch_size, rows):
    return padded_batches(splits['val'], global_batch_size, rows)

  eos = tokenizer_lib.eos_id(tokenizer)
  decode, encode = tokenizer_lib.codec(tokenizer)
  return Dataset(task='grpo', model_fields={'vocab_size': meta['vocab_size']},
                 train_batch=train_batch, eval_batches=eval_batches,
                 num_train=len(train['pad']), token_unit='token', decode=decode, encode=encode,
                 eos_id=eos, stop_ids=(eos,) if eos >= 0 else (), records=records)


def check_config(data_config: ml_collections.ConfigDict) -> None:
  if not data_config.get('path'):
    fail('data.path', 'give the directory that `python -m zoo.prepare prompts` wrote')
  if not storage.is_remote(data_config.path) and not os.path.isdir(data_config.path):
    fail('data.path', f'{data_config.path} is not a directory; give the directory that '
         '`python -m zoo.prepare prompts` wrote')


SOURCE = DataSource(load, task='grpo', check_config=check_config)
