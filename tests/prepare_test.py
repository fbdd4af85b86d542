"""`python -m zoo.prepare`: every input format and tokenizer, the atomic output, bad input."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tokenizers

from conftest import REPO, load_config
from zoo.data import tokens
from zoo.errors import ConfigError
from zoo.run import train

DOCUMENTS = [f'def function_{i}(x):\n    return x * {i}  # caf\u00e9\n' * (1 + i % 4) for i in range(40)]


def run(*args, timeout=120):
  cmd = [sys.executable, '-m', 'zoo.prepare', *map(str, args)]
  return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False)


def _one_line_error(result, message):
  assert result.returncode != 0, result.stderr[-2000:]
  assert 'Traceback' not in result.stderr, result.stderr[-3000:]
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith('zoo: error: ') and message in last, last


def _decoded(path, split):
  """The documents of a prepared split, decoded with its own tokenizer."""
  with open(os.path.join(path, 'metadata.json'), encoding='utf-8') as f:
    meta = json.load(f)
  tokenizer = tokenizers.Tokenizer.from_file(os.path.join(path, 'tokenizer.json'))
  ids = np.concatenate([np.fromfile(os.path.join(path, s['file']), meta['dtype'])
                        for s in meta['splits'][split]['shards']])
  documents = np.split(ids, np.flatnonzero(ids == meta['eos_id']) + 1)[:-1]
  return [tokenizer.decode(d[:-1].tolist()) for d in documents]


@pytest.fixture(scope='module')
def inputs(tmp_path_factory):
  root = tmp_path_factory.mktemp('inputs')
  (root / 'txt').mkdir()
  for i, d in enumerate(DOCUMENTS):
    (root / 'txt' / f'{i:03d}.py').write_text(d, encoding='utf-8')
  with open(root / 'docs.jsonl', 'w', encoding='utf-8') as f:
    f.writelines(json.dumps({'body': d, 'id': i}) + '\n' for i, d in enumerate(DOCUMENTS))
  pq.write_table(pa.table({'content': DOCUMENTS}), root / 'docs.parquet')
  return root


def test_every_format_and_tokenizer_round_trips(inputs, tmp_path):
  """Globs of files + a BPE; JSON Lines + bytes; Parquet + that BPE's tokenizer.json: each
  split decodes to its documents, split by document, in input order."""
  val = [d for i, d in enumerate(DOCUMENTS) if tokens.in_validation(i, 0.2)]
  train_docs = [d for i, d in enumerate(DOCUMENTS) if not tokens.in_validation(i, 0.2)]
  bpe = tmp_path / 'bpe'
  result = run('text', f'--input={inputs}/txt/*.py', f'--output={bpe}', '--tokenizer=bpe',
               '--vocab_size=300', '--val_fraction=0.2', '--shard_tokens=500')
  assert result.returncode == 0, result.stderr[-2000:]
  with open(bpe / 'metadata.json', encoding='utf-8') as f:
    meta = json.load(f)
  assert meta['vocab_size'] == 300 and len(meta['splits']['train']['shards']) > 1
  assert sum(s['tokens'] for s in meta['splits']['train']['shards']) == meta['splits']['train']['tokens']
  for name, flags in (('bytes', ['--input', inputs / 'docs.jsonl', '--field=body', '--tokenizer=bytes']),
                      ('pq', ['--input', inputs / 'docs.parquet', '--column=content',
                              f'--tokenizer={bpe}/tokenizer.json'])):
    result = run('text', *flags, f'--output={tmp_path / name}', '--val_fraction=0.2')
    assert result.returncode == 0, result.stderr[-2000:]
  for path in (bpe, tmp_path / 'bytes', tmp_path / 'pq'):
    assert _decoded(path, 'train') == train_docs and _decoded(path, 'val') == val
    meta = json.loads((path / 'metadata.json').read_text())
    ids = np.concatenate([np.fromfile(path / s['file'], meta['dtype'])
                          for s in meta['splits']['train']['shards']])
    token_bytes = np.load(path / 'token_bytes.npy')  # Each token's bytes: bits per byte.
    assert token_bytes[ids].sum() == meta['splits']['train']['bytes'] == sum(
        len(d.encode('utf-8')) for d in train_docs)
  assert (bpe / 'tokenizer.json').read_text() == (tmp_path / 'pq' / 'tokenizer.json').read_text()
  assert 'bytes per token' in result.stderr and 'tokenizing' in result.stderr  # Summary, bar.


def test_an_existing_output_is_replaced_only_when_asked(inputs, tmp_path):
  out = tmp_path / 'out'
  args = ['text', f'--input={inputs}/docs.jsonl', '--field=body', f'--output={out}', '--val_fraction=0.2']
  assert run(*args).returncode == 0
  before = (out / 'metadata.json').read_text()
  _one_line_error(run(*args), f'--output: {out} exists; give --overwrite to replace it')
  assert (out / 'metadata.json').read_text() == before
  result = run(*args, '--overwrite', '--tokenizer=bpe', '--vocab_size=280')
  assert result.returncode == 0, result.stderr[-2000:]
  assert json.loads((out / 'metadata.json').read_text())['vocab_size'] == 280
  assert sorted(os.listdir(tmp_path)) == ['out']  # Nothing left beside it.


def test_overwrite_replaces_only_datasets_and_survives_a_failed_move(inputs, tmp_path,
                                                                   monkeypatch):
  """--overwrite will not delete a directory that zoo.prepare did not write; if moving the
  new dataset into place fails, the old one is put back."""
  from zoo.data import atomic  # pylint: disable=import-outside-toplevel
  precious = tmp_path / 'precious'
  precious.mkdir()
  (precious / 'notes.txt').write_text('keep me')
  args = ['text', f'--input={inputs}/docs.jsonl', '--field=body', '--val_fraction=0.2']
  _one_line_error(run(*args, f'--output={precious}', '--overwrite'),
                  f'--output: {precious} is not a dataset that zoo.prepare wrote')
  assert (precious / 'notes.txt').read_text() == 'keep me'
  out = tmp_path / 'out'
  assert run(*args, f'--output={out}').returncode == 0
  before = (out / 'train-00000.bin').read_bytes()
  partial = tmp_path / 'new'
  partial.mkdir()
  real_rename = os.rename
  def failing_rename(src, dst):
    if str(src) == str(partial):
      raise OSError(28, 'No space left on device', str(dst))
    real_rename(src, dst)
  monkeypatch.setattr(os, 'rename', failing_rename)
  with pytest.raises(OSError):
    atomic.publish(str(partial), str(out))
  monkeypatch.undo()
  assert (out / 'train-00000.bin').read_bytes() == before  # Back in place.
  assert sorted(p.name for p in tmp_path.iterdir()) == ['new', 'out', 'precious']


def test_a_literal_end_token_in_a_document_stays_text(tmp_path):
  source = tmp_path / 'docs.jsonl'
  docs = ['first <|endoftext|> still the first'] * 3 + ['second'] * 3
  source.write_text(''.join(json.dumps({'text': d}) + '\n' for d in docs))
  assert run('text', f'--input={source}', f'--output={tmp_path / "out"}',
             '--val_fraction=0.5').returncode == 0
  assert sorted(_decoded(tmp_path / 'out', 'train') + _decoded(tmp_path / 'out', 'val')) == sorted(docs)


def test_a_killed_prepare_leaves_nothing_that_trains(tmp_path, devices):
  del devices
  big = tmp_path / 'big.jsonl'
  with open(big, 'w', encoding='utf-8') as f:  # ~64 MB: several seconds to tokenize.
    line = json.dumps({'text': 'x' * 4096}) + '\n'
    f.writelines(line for _ in range(16_000))
  out = tmp_path / 'out'
  proc = subprocess.Popen([sys.executable, '-m', 'zoo.prepare', 'text', f'--input={big}',
                           f'--output={out}'], cwd=REPO, stderr=subprocess.DEVNULL)
  partial = tmp_path / f'out.partial-{proc.pid}'
  deadline = time.time() + 60
  while not (partial / 'train-00000.bin').exists():
    assert time.time() < deadline and proc.poll() is None, 'prepare ended before the kill'
    time.sleep(0.02)
  proc.send_signal(signal.SIGKILL)
  proc.wait(timeout=30)
  assert not out.exists() and partial.exists()
  config = load_config('char_lm', **{'data.name': 'tokens', 'data.path': str(out)})
  with pytest.raises(ConfigError, match=r'config\.data\.path: .*out is not a directory'):
    train.train_and_evaluate(config, str(tmp_path / 'run'))
  config.data.path = str(partial)
  with pytest.raises(ConfigError, match=r'has no metadata\.json: .* preparation did not finish'):
    train.train_and_evaluate(config, str(tmp_path / 'run'))
  assert not (tmp_path / 'run').exists()
  small = tmp_path / 'small.jsonl'
  small.write_text(''.join(json.dumps({'text': d}) + '\n' for d in DOCUMENTS))
  assert run('text', f'--input={small}', f'--output={out}', '--val_fraction=0.2').returncode == 0
  assert not partial.exists()  # The next prepare removed the leftover.


def test_a_corpus_too_small_for_the_val_fraction_rounds_the_val_split_up_to_one_document(
    inputs, tmp_path):
  """No document hashes below --val_fraction=0.001: the val split takes the one whose hash
  is lowest, says so, and the BPE is trained without it."""
  count = len(DOCUMENTS)
  assert not any(tokens.in_validation(i, 0.001) for i in range(count))
  forced = tokens.first_in_validation(count)
  out = tmp_path / 'out'
  result = run('text', f'--input={inputs}/docs.jsonl', '--field=body', '--tokenizer=bpe',
               '--vocab_size=300', '--val_fraction=0.001', f'--output={out}')
  assert result.returncode == 0, result.stderr[-2000:]
  assert (f'no document of {count} went to the val split at --val_fraction=0.001: it holds one '
          f'(document {forced}), the split rounded up') in result.stderr
  meta = json.loads((out / 'metadata.json').read_text())
  assert meta['val_forced'] == forced
  assert meta['splits']['val']['documents'] == 1 and meta['splits']['train']['documents'] == count - 1
  assert _decoded(out, 'val') == [DOCUMENTS[forced]]
  assert _decoded(out, 'train') == [d for i, d in enumerate(DOCUMENTS) if i != forced]
  assert sorted(os.listdir(out)) == sorted(
      ['metadata.json', 'tokenizer.json', 'token_bytes.npy']
      + [s['file'] for split in meta['splits'].values() for s in split['shards']]
      + [split['documents_file'] for split in meta['splits'].values()])


@pytest.mark.parametrize('make,args,message', [
    (None, ['--input=/nonexistent/*.txt'], '--input: /nonexistent/*.txt matches no file'),
    ('empty.txt', [], 'files are empty; give files with text'),
    ('docs.jsonl', ['--field=text'], "--field: {input} line 1 has no string field 'text' (keys: body, id)"),
    ('bad.jsonl', [], '--input: {input} line 2 is not JSON'),
    ('docs.parquet', ['--column=text'], "--column: {input} has no column 'text' (columns: content)"),
    ('latin1.txt', [], '--input: {input} is not UTF-8 text'),
    ('docs.jsonl', ['--field=body', '--tokenizer=missing.json'], '--tokenizer: missing.json is not a file'),
    ('docs.jsonl', ['--field=body', '--tokenizer={bad_tokenizer}'], 'is not a valid tokenizer.json'),
    ('docs.jsonl', ['--field=body', '--val_fraction=0'], '--val_fraction: must be in (0, 1), got 0.0'),
    ('docs.jsonl', ['--field=body', '--val_fraction=1.5'], '--val_fraction: must be in (0, 1), got 1.5'),
    ('docs.jsonl', ['--field=body', '--tokenizer=bpe', '--vocab_size=100'], '--vocab_size: 100 is too small'),
])
def test_bad_text_input_is_one_line_and_writes_nothing(inputs, tmp_path, make, args, message):
  source = {'empty.txt': tmp_path / 'empty.txt', 'bad.jsonl': tmp_path / 'bad.jsonl',
            'latin1.txt': tmp_path / 'latin1.txt'}.get(make, inputs / str(make))
  (tmp_path / 'empty.txt').write_text('')
  (tmp_path / 'bad.jsonl').write_text('{"text": "ok"}\n{not json\n')
  (tmp_path / 'latin1.txt').write_bytes('caf\u00e9'.encode('latin-1'))
  (tmp_path / 'bad_tokenizer.json').write_text('{"model": 3}')
  args = [a.format(bad_tokenizer=tmp_path / 'bad_tokenizer.json') for a in args]
  has_input = any(a.startswith('--input') for a in args)
  out = tmp_path / 'out' / 'nested'
  result = run('text', *([] if has_input else [f'--input={source}']), *args, f'--output={out}')
  _one_line_error(result, message.format(input=source))
  assert not (tmp_path / 'out').exists()


def _images(root, sizes=((8, 8),) * 3, classes=('a', 'b')):
  """len(sizes) training images per class, and one validation image per class."""
  from PIL import Image  # pylint: disable=import-outside-toplevel
  for c in classes:
    for split, split_sizes in (('train', sizes), ('val', sizes[:1])):
      os.makedirs(root / split / c, exist_ok=True)
      for i, size in enumerate(split_sizes):
        Image.fromarray(np.full(size[::-1], 40 * i, np.uint8)).save(root / split / c / f'{i}.png')


@pytest.mark.parametrize('damage,message', [
    ('corrupt', '--input: 2 of 10 images cannot be read: {root}/train/a/bad0.png (UnidentifiedImageError'),
    ('empty_class', '--input: class folder {root}/train/c has no images'),
    ('sizes', '--input: images differ in size ('),
    ('no_train', '--input: {root} has no train/ folder'),
    ('val_class', '--input: {root}/val/z is a class that train/ does not have'),
])
def test_bad_image_folders_are_named(tmp_path, damage, message):
  root = tmp_path / 'images'
  _images(root, sizes=((8, 8), (8, 8), (9, 8)) if damage == 'sizes' else ((8, 8),) * 3)
  if damage == 'corrupt':
    for i in range(2):
      (root / 'train' / 'a' / f'bad{i}.png').write_bytes(b'not a png')
  elif damage == 'empty_class':
    (root / 'train' / 'c').mkdir()
  elif damage == 'no_train':
    os.rename(root / 'train', root / 'training')
  elif damage == 'val_class':
    (root / 'val' / 'z').mkdir(parents=True)
  _one_line_error(run('images', f'--input={root}', f'--output={tmp_path / "out"}'),
                  message.format(root=root))
  assert not (tmp_path / 'out').exists()


def test_images_of_other_sizes_are_resized_when_asked(tmp_path):
  root = tmp_path / 'images'
  _images(root, sizes=((8, 8), (12, 10), (9, 16)))
  result = run('images', f'--input={root}', f'--output={tmp_path / "out"}', '--image_size=6')
  assert result.returncode == 0, result.stderr[-2000:]
  meta = json.loads((tmp_path / 'out' / 'metadata.json').read_text())
  assert meta['image_shape'] == [6, 6, 1] and meta['classes'] == ['a', 'b']
  assert [meta['splits'][s]['examples'] for s in ('train', 'val')] == [6, 2]


def test_an_image_tree_too_small_for_the_val_fraction_rounds_the_val_split_up_to_one(tmp_path):
  root = tmp_path / 'images'
  _images(root)
  shutil.rmtree(root / 'val')  # Split by --val_fraction: 6 images, none hashes below 0.01.
  result = run('images', f'--input={root}', f'--output={tmp_path / "out"}')
  assert result.returncode == 0, result.stderr[-2000:]
  assert ('no image of 6 went to the val split at --val_fraction=0.01: it holds one, the split '
          'rounded up') in result.stderr
  meta = json.loads((tmp_path / 'out' / 'metadata.json').read_text())
  assert [meta['splits'][s]['examples'] for s in ('train', 'val')] == [5, 1]
