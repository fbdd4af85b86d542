"""Writing the datasets that training reads per process: what `python -m zoo.prepare
text|images` runs (its flags are the fields of `Options`).

`text` writes a token dataset (zoo.data.tokens), `images` a record dataset (zoo.data.records).
The output appears whole or not at all: it is written into `OUTPUT.partial-<pid>` and
renamed when complete (zoo.data.atomic), so an interrupted prepare leaves nothing that
training accepts; in a bucket it is built locally and copied with its metadata.json last.
An existing OUTPUT is replaced only with `overwrite`. A progress bar on stderr shows bytes
(and images), rate and ETA.
"""
import contextlib
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Callable

from absl import logging

from zoo.data import atomic, dataset
from zoo.errors import ConfigError, ZooError
from zoo.store import storage


@dataclasses.dataclass(frozen=True)
class Options:
  """What to read and write; zoo.prepare's flags of the same names document each."""
  inputs: tuple
  output: str
  exclude: tuple = ()
  skip_undecodable: bool = False
  overwrite: bool = False
  val_fraction: float = 0.01
  seed: int = 0
  tokenizer: str = 'bytes'
  vocab_size: int = 8192
  field: str = 'text'
  column: str = 'text'
  shard_tokens: int = 2**28
  image_size: int = 0
  shard_examples: int = 4096
  store: str = 'auto'
  chat_template: str = ''


KINDS = ('text', 'chat', 'preference', 'prompts', 'images')
# Token datasets: a validation split, bucket outputs.
TOKEN_KINDS = ('text', 'chat', 'preference', 'prompts')


def progress_bar(total: int, description: str, unit: str = 'B'):
  """A tqdm bar on stderr: done, rate and ETA (bytes scaled to k, M, G)."""
  from tqdm import tqdm  # pylint: disable=import-outside-toplevel
  return tqdm(total=total, desc=description, unit=unit, unit_scale=True, unit_divisor=1024,
              dynamic_ncols=True, mininterval=0.5, file=sys.stderr)


def text_writer(o: Options) -> Callable[[str], str]:
  """Checks the inputs and makes the tokenizer (training a BPE reads the training documents
  once); returns partial -> summary, which writes the token dataset."""
  from zoo.data import documents, tokens  # pylint: disable=import-outside-toplevel
  files = documents.expand(o.inputs, o.exclude)
  if o.skip_undecodable and (bad := documents.undecodable(files)):
    logging.warning('leaving out %d files that are not UTF-8: %s', len(bad), ', '.join(bad))
    files = [f for f in files if f not in set(bad)]
  total = sum(os.path.getsize(f) for f in files)
  if not total:
    raise ConfigError(f'--input: the {len(files)} files are empty; give files with text')
  if o.shard_tokens <= 0:
    raise ConfigError(f'--shard_tokens: must be positive, got {o.shard_tokens}')
  options = dict(field=o.field, column=o.column, val_fraction=o.val_fraction,
                 seed=o.seed)

  def make_tokenizer(forced):
    if o.tokenizer == 'bpe':
      logging.info('training a byte-level BPE of %d tokens on the training documents',
                   o.vocab_size)
    return tokens.make_tokenizer(o.tokenizer, o.vocab_size, tokens.split_documents(
        files, want='train', forced=forced, **options))
  tokenizer = make_tokenizer(-1)

  def attempt(partial, forced):
    nonlocal tokenizer
    if forced >= 0 and o.tokenizer == 'bpe':  # Trained on the training documents only.
      tokenizer = make_tokenizer(forced)
    with progress_bar(total, 'tokenizing') as bar:
      meta = tokens.prepare(files, partial, tokenizer, shard_tokens=o.shard_tokens,
                            progress=bar, forced=forced, **options)
      bar.update(total - bar.n)  # Files hold more than their documents' text (JSON, Parquet).
    return f'vocabulary {meta["vocab_size"]:,}\n' + tokens.describe(meta)
  return lambda partial: _val_rounded_up(attempt, partial, o, 'document')


def _val_rounded_up(attempt: Callable[[str, int], str], partial: str, o: Options,
                    unit: str) -> str:
  """attempt(partial, forced=-1), and if no document went to the validation split (a small
  corpus), again from scratch with the one a larger fraction would take first."""
  from zoo.data import tokens  # pylint: disable=import-outside-toplevel
  try:
    return attempt(partial, -1)
  except tokens.EmptyValSplit as e:
    forced = tokens.first_in_validation(e.documents, o.seed)
    logging.warning('no %s of %d went to the val split at --val_fraction=%g: it holds one '
                    '(%s %d), the split rounded up', unit, e.documents, o.val_fraction, unit,
                    forced)
    for name in os.listdir(partial):
      os.remove(os.path.join(partial, name))
    return attempt(partial, forced)


def chat_writer(o: Options) -> Callable[[str], str]:
  """Checks the inputs, the model's tokenizer and its chat template; returns partial ->
  summary, which writes the conversations as a token dataset with a loss mask
  (zoo.data.chat)."""
  from zoo.data import chat, documents, tokens  # pylint: disable=import-outside-toplevel
  from zoo.data import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
  files = documents.expand(o.inputs, o.exclude)
  if not all(f.endswith('.jsonl') for f in files):
    raise ConfigError('--input: conversations are JSON Lines files (.jsonl), one '
                      '{"messages": [...]} per line; got ' + ', '.join(files[:3]))
  if o.shard_tokens <= 0:
    raise ConfigError(f'--shard_tokens: must be positive, got {o.shard_tokens}')
  if o.tokenizer in ('bytes', 'bpe'):
    raise ConfigError(f'--tokenizer: chat data is tokenized by the model\'s own tokenizer: give '
                      'its directory (a Hugging Face model\'s, or the zoo workdir it was '
                      f'imported into), not {o.tokenizer!r}')
  directory = o.tokenizer if os.path.isdir(o.tokenizer) else os.path.dirname(o.tokenizer)
  tokenizer_file = (os.path.join(o.tokenizer, 'tokenizer.json') if os.path.isdir(o.tokenizer)
                    else o.tokenizer)
  tokenizer = tokenizer_lib.load(tokenizer_file, '--tokenizer',
                                 'give the model\'s tokenizer directory')
  template = chat.load_template(directory, o.chat_template)
  field = 'messages' if o.field == 'text' else o.field  # --field's default names text.
  total = sum(os.path.getsize(f) for f in files)

  def attempt(partial, forced):
    with progress_bar(total, 'rendering') as bar:
      meta = chat.prepare(files, partial, tokenizer, template, field=field,
                          val_fraction=o.val_fraction, seed=o.seed, forced=forced,
                          shard_tokens=o.shard_tokens, progress=bar)
      bar.update(total - bar.n)
    targets = {name: meta['splits'][name]['targets'] for name in tokens.SPLITS}
    return (f'vocabulary {meta["vocab_size"]:,}; chat template {template.where}\n'
            + tokens.describe(meta) + '\n' + ', '.join(
                f'{name}: {targets[name]:,} assistant tokens, '
                f'{targets[name] / max(meta["splits"][name]["tokens"], 1):.1%} of the split'
                for name in tokens.SPLITS))
  return lambda partial: _val_rounded_up(attempt, partial, o, 'conversation')


def _records_writer(o: Options, module: Any, what: str, example: str) -> Callable[[str], str]:
  """Checks the inputs and the model's tokenizer; returns partial -> summary, which writes
  the JSON Lines records with `module.prepare` (preference pairs, prompts)."""
  from zoo.data import documents  # pylint: disable=import-outside-toplevel
  files = documents.expand(o.inputs, o.exclude)
  if not all(f.endswith('.jsonl') for f in files):
    raise ConfigError(f'--input: {what} are JSON Lines files (.jsonl), one {example} per line; '
                      'got ' + ', '.join(files[:3]))
  if o.tokenizer in ('bytes', 'bpe'):
    raise ConfigError(f'--tokenizer: {what} are tokenized by the model\'s own tokenizer: give '
                      f'its directory, its zoo workdir or its tokenizer.json, not {o.tokenizer!r}')

  def write(partial):
    meta = module.prepare(files, partial, o.tokenizer, val_fraction=o.val_fraction, seed=o.seed,
                          chat_template=o.chat_template)
    return f'vocabulary {meta["vocab_size"]:,}\n' + module.describe(meta)
  return write


def preference_writer(o: Options) -> Callable[[str], str]:
  from zoo.data import preference  # pylint: disable=import-outside-toplevel
  return _records_writer(o, preference, 'preference pairs',
                         '{"prompt": ..., "chosen": ..., "rejected": ...}')


def prompts_writer(o: Options) -> Callable[[str], str]:
  from zoo.data import prompts  # pylint: disable=import-outside-toplevel
  return _records_writer(o, prompts, 'prompts', '{"prompt": ..., <fields for the rewards>}')


def images_writer(o: Options) -> Callable[[str], str]:
  """Checks the image-folder tree (every image is decoded once); returns partial -> summary,
  which writes the record dataset."""
  from zoo.data import records  # pylint: disable=import-outside-toplevel
  if len(o.inputs) != 1 or not os.path.isdir(o.inputs[0]):
    raise ConfigError(f'--input: {",".join(o.inputs) or "missing"}: give one directory, the root '
                      'of an image-folder tree (ROOT/train/<class>/*.png)')
  plan = records.plan(o.inputs[0], val_fraction=o.val_fraction, seed=o.seed,
                      image_size=o.image_size, progress_bar=progress_bar,
                      store=o.store)

  def write(partial):
    meta = records.prepare(plan, partial, shard_examples=o.shard_examples,
                           progress_bar=progress_bar)
    return records.describe(meta)
  return write


def run(kind: str, o: Options) -> None:
  """Writes the dataset `o` describes (see zoo/prepare.py); ConfigError or OSError on bad
  input or a failed write, after which nothing is left at o.output."""
  if kind not in KINDS:
    raise ConfigError(f'unknown kind {kind!r}; give one of: {", ".join(KINDS)} '
                      '(python -m zoo.prepare text|chat|preference|prompts|images --input=... '
                      '--output=...)')
  tokens = kind in TOKEN_KINDS
  if not 0 <= o.val_fraction < 1 or (tokens and not o.val_fraction):
    raise ConfigError(f'--val_fraction: must be in {"(0" if tokens else "[0"}, 1), got '
                      f'{o.val_fraction}' + ('; a token dataset needs a validation split'
                                             if tokens else ''))
  t0 = time.perf_counter()
  if storage.is_remote(o.output):
    _run_to_bucket(kind, o, t0)
    return
  path = atomic.check_output(o.output, o.overwrite)
  write = {'text': text_writer, 'chat': chat_writer, 'preference': preference_writer,
           'prompts': prompts_writer, 'images': images_writer}[kind](o)
  partial = f'{path}.partial-{os.getpid()}'
  created = [d for d in atomic.ancestors(partial) if not os.path.exists(d)]
  os.makedirs(partial)
  try:
    summary = write(partial)
    old = atomic.publish(partial, path)
  except BaseException:
    shutil.rmtree(partial, ignore_errors=True)
    for directory in reversed(created[:-1]):  # Parents this run made, if still empty.
      if os.path.isdir(directory) and not os.listdir(directory):
        os.rmdir(directory)
    raise
  logging.info('wrote %s in %.1f s:\n%s', path, time.perf_counter() - t0, summary)
  if old:  # The new dataset is in place; an interrupted removal is finished by the next run.
    shutil.rmtree(old, ignore_errors=True)


def _run_to_bucket(kind: str, o: Options, t0: float) -> None:
  """A token dataset written here, then copied into the bucket with its metadata.json last:
  until that lands, training refuses the prefix as unfinished. (Record datasets are read
  through a gcsfuse mount, so they are written there as to a local path.)"""
  url = o.output
  if kind not in TOKEN_KINDS:
    raise ConfigError(f'--output: {url}: record datasets are read through a local path; mount '
                      'the bucket with gcsfuse and give the mounted path as --output')
  storage.check_bucket(url, '--output')
  if len(url.rstrip('/').split('/')) < 4:
    raise ConfigError(f'--output: {url} is a whole bucket; give a path inside it '
                      '(gs://BUCKET/DATASET)')
  meta = storage.join(url, dataset.METADATA)
  if storage.path(url).exists():
    if not o.overwrite:
      raise ConfigError(f'--output: {url} exists; give --overwrite to replace it, or another '
                        '--output')
    if not atomic.is_dataset(url):
      raise ConfigError(f'--output: {url} is not a dataset that zoo.prepare wrote (no zoo '
                        'metadata.json), so --overwrite will not replace it; pick another --output')
  write = {'text': text_writer, 'chat': chat_writer, 'preference': preference_writer,
           'prompts': prompts_writer}[kind](o)
  with tempfile.TemporaryDirectory(prefix='zoo-prepare-') as local:  # $TMPDIR: room for it.
    summary = write(local)
    try:
      if storage.is_file(meta):  # Unfinished from here on: training refuses it.
        storage.path(meta).unlink()
      storage.remove_tree(url)
      storage.upload_tree(local, url, last=dataset.METADATA)
    except BaseException:
      with contextlib.suppress(Exception):  # Best effort: without metadata.json it is refused.
        storage.remove_tree(url)
      raise ZooError(f'--output: {url}: the copy into the bucket did not finish; what it wrote '
                     'was removed (or is refused by training without its metadata.json). Run '
                     'the same command again with --overwrite') from None
  logging.info('wrote %s in %.1f s:\n%s', url, time.perf_counter() - t0, summary)
