r"""Builds datasets that training reads per process: `python -m zoo.prepare text|images`.

    python -m zoo.prepare text --input='corpus/*.txt' --output=data/corpus --tokenizer=bpe \
        --vocab_size=8192
    python -m zoo.prepare text --input=docs.jsonl --field=text --output=data/docs --tokenizer=bytes
    python -m zoo.prepare text --input=part-0.parquet --column=text --output=data/pq \
        --tokenizer=path/to/tokenizer.json
    python -m zoo.prepare images --input=path/to/imagefolder --output=data/images

`text` writes a token dataset (zoo.data.tokens: `--config.data.name=tokens`), `images` a
record dataset (zoo.data.records: `--config.data.name=records`). The output appears whole
or not at all: it is written into `OUTPUT.partial-<pid>` and renamed when complete, so an
interrupted prepare leaves nothing that training accepts. An existing OUTPUT is replaced
only with --overwrite. A progress bar on stderr shows bytes (and images), rate and ETA.
"""
import os
import shutil
import sys
import time
from typing import Callable

from absl import flags
from absl import logging

from zoo import shell
from zoo.data import atomic, dataset
from zoo.errors import ConfigError, ZooError
from zoo.store import storage

_INPUT = flags.DEFINE_multi_string(
    'input', [], 'text: files or globs (repeat the flag for several; quote globs); .jsonl and '
    '.parquet hold one document per line or row, any other file is one document. images: the '
    'root of an image-folder tree (ROOT/train/<class>/*.png|jpg, optional ROOT/val/<class>/).')
_EXCLUDE = flags.DEFINE_multi_string(
    'exclude', [], "text: leave out the files that match this glob, e.g. '*/site-packages/*'.")
_SKIP_UNDECODABLE = flags.DEFINE_bool(
    'skip_undecodable', False, 'text: leave out (and list) the text files that are not UTF-8, '
    'instead of stopping at the first.')
_OUTPUT = flags.DEFINE_string('output', None, 'The dataset directory to write.')
_OVERWRITE = flags.DEFINE_bool('overwrite', False, 'Replace an existing --output.')
_VAL_FRACTION = flags.DEFINE_float(
    'val_fraction', 0.01, 'Fraction of documents (text), or of training images when there is no '
    'val/ folder (images), held out for validation.')
_SEED = flags.DEFINE_integer('seed', 0, 'Seeds the train/validation split.')
_TOKENIZER = flags.DEFINE_string(
    'tokenizer', 'bytes', "text: 'bytes' (one token per UTF-8 byte), 'bpe' (a byte-level BPE "
    'trained on the training documents) or a path to a tokenizer.json.')
_VOCAB_SIZE = flags.DEFINE_integer('vocab_size', 8192,
                                   "text: the BPE's vocabulary (--tokenizer=bpe).")
_FIELD = flags.DEFINE_string('field', 'text', 'text: the JSON Lines field that holds a document.')
_COLUMN = flags.DEFINE_string('column', 'text', 'text: the Parquet column that holds a document.')
_SHARD_TOKENS = flags.DEFINE_integer('shard_tokens', 2**28, 'text: tokens per shard file.')
_IMAGE_SIZE = flags.DEFINE_integer(
    'image_size', 0, 'images: resize the shorter side to this and crop the centre square '
    '(needed when the images differ in size); 0: keep them as they are.')
_SHARD_EXAMPLES = flags.DEFINE_integer('shard_examples', 4096, 'images: images per record file.')
_STORE = flags.DEFINE_enum(
    'store', 'auto', ['auto', 'pixels', 'file'], 'images: what a record holds: its pixels '
    '(no decoding when read), its PNG/JPEG file (smaller, decoded when read), or auto: pixels '
    'for images of at most 64x64x3 bytes.')
flags.mark_flags_as_required(['output'])

KINDS = ('text', 'images')


def progress_bar(total: int, description: str, unit: str = 'B'):
  """A tqdm bar on stderr: done, rate and ETA (bytes scaled to k, M, G)."""
  from tqdm import tqdm  # pylint: disable=import-outside-toplevel
  return tqdm(total=total, desc=description, unit=unit, unit_scale=True, unit_divisor=1024,
              dynamic_ncols=True, mininterval=0.5, file=sys.stderr)


def text_writer(patterns: list[str]) -> Callable[[str], str]:
  """Checks the inputs and makes the tokenizer (training a BPE reads the training documents
  once); returns partial -> summary, which writes the token dataset."""
  from zoo.data import documents, tokens  # pylint: disable=import-outside-toplevel
  files = documents.expand(patterns, _EXCLUDE.value)
  if _SKIP_UNDECODABLE.value and (bad := documents.undecodable(files)):
    logging.warning('leaving out %d files that are not UTF-8: %s', len(bad), ', '.join(bad))
    files = [f for f in files if f not in set(bad)]
  total = sum(os.path.getsize(f) for f in files)
  if not total:
    raise ConfigError(f'--input: the {len(files)} files are empty; give files with text')
  if _SHARD_TOKENS.value <= 0:
    raise ConfigError(f'--shard_tokens: must be positive, got {_SHARD_TOKENS.value}')
  options = dict(field=_FIELD.value, column=_COLUMN.value, val_fraction=_VAL_FRACTION.value,
                 seed=_SEED.value)

  def make_tokenizer(forced):
    if _TOKENIZER.value == 'bpe':
      logging.info('training a byte-level BPE of %d tokens on the training documents',
                   _VOCAB_SIZE.value)
    return tokens.make_tokenizer(_TOKENIZER.value, _VOCAB_SIZE.value, tokens.split_documents(
        files, want='train', forced=forced, **options))
  tokenizer = make_tokenizer(-1)

  def write(partial):
    nonlocal tokenizer
    forced = -1
    while True:
      with progress_bar(total, 'tokenizing') as bar:
        try:
          meta = tokens.prepare(files, partial, tokenizer, shard_tokens=_SHARD_TOKENS.value,
                                progress=bar, forced=forced, **options)
        except tokens.EmptyValSplit as e:  # A small corpus: again, with one val document.
          forced = tokens.first_in_validation(e.documents, _SEED.value)
          logging.warning('no document of %d went to the val split at --val_fraction=%g: it '
                          'holds one (document %d), the split rounded up', e.documents,
                          _VAL_FRACTION.value, forced)
          for name in os.listdir(partial):
            os.remove(os.path.join(partial, name))
          if _TOKENIZER.value == 'bpe':  # Trained on the training documents only.
            tokenizer = make_tokenizer(forced)
          continue
        bar.update(total - bar.n)  # Files hold more than their documents' text (JSON, Parquet).
      return f'vocabulary {meta["vocab_size"]:,}\n' + tokens.describe(meta)
  return write


def images_writer(patterns: list[str]) -> Callable[[str], str]:
  """Checks the image-folder tree (every image is decoded once); returns partial -> summary,
  which writes the record dataset."""
  from zoo.data import records  # pylint: disable=import-outside-toplevel
  if len(patterns) != 1 or not os.path.isdir(patterns[0]):
    raise ConfigError(f'--input: {",".join(patterns) or "missing"}: give one directory, the root '
                      'of an image-folder tree (ROOT/train/<class>/*.png)')
  plan = records.plan(patterns[0], val_fraction=_VAL_FRACTION.value, seed=_SEED.value,
                      image_size=_IMAGE_SIZE.value, progress_bar=progress_bar,
                      store=_STORE.value)

  def write(partial):
    meta = records.prepare(plan, partial, shard_examples=_SHARD_EXAMPLES.value,
                           progress_bar=progress_bar)
    return records.describe(meta)
  return write


def run(kind: str) -> None:
  if kind not in KINDS:
    raise ConfigError(f'unknown kind {kind!r}; give one of: {", ".join(KINDS)} '
                      '(python -m zoo.prepare text|images --input=... --output=...)')
  if not 0 <= _VAL_FRACTION.value < 1 or (kind == 'text' and not _VAL_FRACTION.value):
    raise ConfigError(f'--val_fraction: must be in {"(0" if kind == "text" else "[0"}, 1), got '
                      f'{_VAL_FRACTION.value}' + ('; a token dataset needs a validation split'
                                                  if kind == 'text' else ''))
  t0 = time.perf_counter()
  if storage.is_remote(_OUTPUT.value):
    _run_to_bucket(kind, _OUTPUT.value, t0)
    return
  path = atomic.check_output(_OUTPUT.value, _OVERWRITE.value)
  write = (text_writer if kind == 'text' else images_writer)(_INPUT.value)
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


def _run_to_bucket(kind: str, url: str, t0: float) -> None:
  """A token dataset written here, then copied into the bucket with its metadata.json last:
  until that lands, training refuses the prefix as unfinished. (Record datasets are read
  through a gcsfuse mount, so they are written there as to a local path.)"""
  import contextlib  # pylint: disable=import-outside-toplevel
  import tempfile  # pylint: disable=import-outside-toplevel
  if kind != 'text':
    raise ConfigError(f'--output: {url}: record datasets are read through a local path; mount '
                      'the bucket with gcsfuse and give the mounted path as --output')
  storage.check_bucket(url, '--output')
  if len(url.rstrip('/').split('/')) < 4:
    raise ConfigError(f'--output: {url} is a whole bucket; give a path inside it '
                      '(gs://BUCKET/DATASET)')
  meta = storage.join(url, dataset.METADATA)
  if storage.path(url).exists():
    if not _OVERWRITE.value:
      raise ConfigError(f'--output: {url} exists; give --overwrite to replace it, or another '
                        '--output')
    if not atomic.is_dataset(url):
      raise ConfigError(f'--output: {url} is not a dataset that zoo.prepare wrote (no zoo '
                        'metadata.json), so --overwrite will not replace it; pick another --output')
  write = text_writer(_INPUT.value)
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


def main(argv: list[str]) -> None:
  if len(argv) != 2:
    raise ZooError(f'give one kind, text or images: python -m zoo.prepare text|images '
                   f'--input=... --output=... (got {argv[1:]})')
  try:
    run(argv[1])
  except OSError as e:  # A full disk, a permission taken away, a file gone meanwhile.
    raise ZooError(f'{e.filename or "--output"}: {e.strerror or e}; nothing was written') from None
  except KeyboardInterrupt:
    raise ZooError('interrupted; nothing was written') from None


if __name__ == '__main__':
  shell.define_flags(devices=False)
  shell.run(main)
