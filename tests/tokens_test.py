"""Token datasets: training on them, exact resume, the same batches everywhere, bits per byte,
and every bad dataset named with its fix."""
import json
import math
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import REPO, load_config, read_metrics, stop_at, trainer
from zoo import data
from zoo.data import tokens
from zoo.errors import ConfigError, ZooError
from zoo.run import train

# A corpus with multi-byte characters: bytes per token and per character differ.
DOCUMENTS = [f'Document {i}: caf\u00e9 na\u00efve \u2603 ' + 'the quick brown fox jumps. ' * (5 + i % 7)
             for i in range(60)]


def prepare(output, *args, documents=DOCUMENTS, tokenizer='bytes'):
  """Runs `python -m zoo.prepare text` on `documents` written as JSON Lines."""
  source = f'{output}.jsonl'
  with open(source, 'w', encoding='utf-8') as f:
    f.writelines(json.dumps({'text': d}) + '\n' for d in documents)
  cmd = [sys.executable, '-m', 'zoo.prepare', 'text', f'--input={source}', f'--output={output}',
         f'--tokenizer={tokenizer}', '--val_fraction=0.2', *args]
  return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture(scope='module')
def dataset_dir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp('tokens') / 'bytes')
  result = prepare(path)
  assert result.returncode == 0, result.stderr[-2000:]
  return path


# The mesh and length of this file's runs and in-process Trainers (the mesh test adds
# (8, 1)): their train, eval and initialisation programs (the schedule's length is in the
# train step's) are compiled once.
MESH = (2, 4)
STRAIGHT = {'train.steps': 12, 'checkpoint.every_steps': 4, 'eval.every_steps': 12}


def _config(path, **overrides):
  return load_config('char_lm', **{'data.name': 'tokens', 'data.path': path, 'mesh.shape': MESH,
                                   'train.log_every_steps': 1, **overrides})


def _trainer(dataset_dir, shape=MESH, **overrides):
  """char_lm on the tokens in process on mesh `shape`, its eval over the whole val split:
  the same Trainer (the programs of this file's runs) for each test here on that mesh."""
  return trainer('char_lm', **{'data.name': 'tokens', 'data.path': dataset_dir,
                               'mesh.shape': shape, 'eval.max_batches': 0,
                               'train.steps': STRAIGHT['train.steps'], **overrides})


def test_prepared_tokens_decode_to_the_documents(dataset_dir):
  with open(os.path.join(dataset_dir, 'metadata.json'), encoding='utf-8') as f:
    meta = json.load(f)
  assert meta['vocab_size'] == 257 and meta['dtype'] == '<u2' and meta['eos_id'] == 256
  splits = {name: [d for i, d in enumerate(DOCUMENTS)
                   if (name == 'val') == tokens.in_validation(i, 0.2)] for name in tokens.SPLITS}
  for name in tokens.SPLITS:
    ids = np.fromfile(os.path.join(dataset_dir, f'{name}-00000.bin'), '<u2')
    assert meta['splits'][name]['documents'] == len(splits[name]) > 0
    want = b''.join(d.encode('utf-8') + b'\xff' for d in splits[name])  # 0xff stands for EOS.
    assert bytes(np.where(ids == 256, 255, ids).astype(np.uint8)) == want
    assert meta['splits'][name]['bytes'] == sum(len(d.encode('utf-8')) for d in splits[name])


def test_windows_are_a_function_of_seed_step_and_row(dataset_dir):
  config = _config(dataset_dir)
  a, b = data.load(config.data, 3), data.load(config.data, 3)
  full = a.train_batch(7, 16, slice(None))
  halves = [b.train_batch(7, 16, slice(0, 8)), b.train_batch(7, 16, slice(8, 16))]
  for key in ('inputs', 'targets'):
    np.testing.assert_array_equal(np.concatenate([h[key] for h in halves]), full[key])
  np.testing.assert_array_equal(full['inputs'][:, 1:], full['targets'][:, :-1])
  assert b.examples_read() == 16 and a.examples_read() == 16  # Each read only its rows.
  assert not np.array_equal(a.train_batch(8, 16, slice(None))['inputs'], full['inputs'])


def test_bits_per_byte_is_bits_per_character_times_characters_per_byte(dataset_dir, devices):
  """Eval's bits per byte against the model's own losses over the validation windows, the
  characters they decode to and their UTF-8 bytes (end-of-document tokens cost bits, and
  are no bytes)."""
  del devices
  t = _trainer(dataset_dir)
  t.run(STRAIGHT['train.steps'])
  result = train.evaluate(t.eval_step, t.state, t.setup)
  apply = jax.jit(lambda params, batch: jax.nn.log_softmax(t.model.apply(
      {'params': params}, batch['inputs'], segments_BL=batch['segments'],
      positions_BL=batch['positions'])))
  bits, text = 0.0, b''
  for batch in t.dataset.eval_batches(16, slice(None)):
    log_probs = np.asarray(apply(t.state.params, batch))
    counted = (batch['weights'][:, None] > 0) & (batch['mask'] > 0)  # Not padding.
    targets = batch['targets'][counted]
    losses = -np.take_along_axis(log_probs[counted], targets[..., None], -1)
    bits += losses.sum() / math.log(2)
    text += bytes(targets[targets < 256].astype(np.uint8))
  characters = len(text.decode('utf-8', 'replace'))  # Windows may split a character's bytes.
  bits_per_char, chars_per_byte = bits / characters, characters / len(text)
  assert result['eval/bits_per_byte'] == pytest.approx(bits_per_char * chars_per_byte, rel=1e-4)
  assert result['eval/bits_per_token'] == pytest.approx(result['eval/loss'] / math.log(2))
  assert chars_per_byte < 0.99  # Multi-byte characters: per byte and per character differ.


def test_stop_and_resume_is_exact(dataset_dir, tmp_path, monkeypatch, devices):
  del devices
  config = lambda: _config(dataset_dir, **STRAIGHT)
  train.train_and_evaluate(config(), str(tmp_path / 'straight'))
  stop_at(monkeypatch, 6)
  train.train_and_evaluate(config(), str(tmp_path / 'resumed'))
  monkeypatch.undo()
  train.train_and_evaluate(config(), str(tmp_path / 'resumed'))
  rows = lambda d: [{k: v for k, v in r.items() if not k.startswith('perf/')}
                    for r in read_metrics(str(tmp_path / d))]
  assert rows('resumed') == rows('straight')  # Every step's loss and the evals, exactly.


def test_same_losses_on_every_mesh(dataset_dir, devices):
  del devices
  runs = [_trainer(dataset_dir, shape).run(4) for shape in [(8, 1), (2, 4)]]
  np.testing.assert_allclose(runs[0], runs[1], rtol=2e-5)


def _damaged(dataset_dir, tmp_path, how):
  path = str(tmp_path / 'damaged')
  shutil.copytree(dataset_dir, path)
  meta_path = os.path.join(path, 'metadata.json')
  with open(meta_path, encoding='utf-8') as f:
    meta = json.load(f)
  if how == 'truncated':
    with open(os.path.join(path, 'train-00000.bin'), 'r+b') as f:
      f.truncate(os.path.getsize(os.path.join(path, 'train-00000.bin')) - 1)
  elif how == 'version':
    meta['version'] = 99
  elif how == 'partial':
    os.remove(meta_path)
  elif how == 'tokenizer':
    with open(os.path.join(path, 'tokenizer.json'), 'w', encoding='utf-8') as f:
      f.write('{"not": "a tokenizer"}')
  elif how == 'no_tokenizer':
    os.remove(os.path.join(path, 'tokenizer.json'))
  elif how == 'token_bytes':
    np.save(os.path.join(path, 'token_bytes.npy'), np.ones(3, np.int32))
  elif how == 'no_index':
    del meta['splits']['train']['documents_file']
  elif how == 'index':
    np.save(os.path.join(path, 'val-documents.npy'), np.array([5, 3], np.int64))
  if how in ('version', 'no_index'):
    with open(meta_path, 'w', encoding='utf-8') as f:
      json.dump(meta, f)
  return path


@pytest.mark.parametrize('how,overrides,message', [
    ('truncated', {}, r'config\.data\.path: shard .*train-00000\.bin is truncated or damaged: '
                      r'\d+ bytes, but \d+ uint16 tokens'),
    ('version', {}, r'config\.data\.path: .* was prepared by format version 99, but this zoo reads '
                    r'version 1 or 2; prepare it again'),
    ('partial', {}, r'config\.data\.path: .* has no metadata\.json: .* preparation did not finish'),
    ('tokenizer', {}, r'config\.data\.path: .*tokenizer\.json is not a valid tokenizer\.json '
                      r'\(.*\); prepare the dataset again'),
    ('no_tokenizer', {}, r'config\.data\.path: .*tokenizer\.json is not a file; prepare the '
                         r'dataset again'),
    ('token_bytes', {}, r'config\.data\.path: token_bytes\.npy has \(3,\) entries for a '
                        r'vocabulary of 257; prepare the dataset again'),
    ('no_index', {}, r'config\.data\.path: .*: metadata\.json names no document index for the '
                     r'train split; prepare the dataset again'),
    ('index', {}, r'config\.data\.path: .*val-documents\.npy does not index the \d+ tokens of '
                  r'the val split; prepare the dataset again'),
    ('intact', {'data.path': ''}, r'config\.data\.path: is empty; give the directory'),
    ('intact', {'model.vocab_size': 100},
     r'config\.model\.vocab_size: 100 is smaller than the 257 that the data .* needs'),
    ('intact', {'data.seq_len': 'VAL', 'data.windows': 'stream'},  # Longer than the val split.
     r'config\.data\.path: the validation split of .* has \d+ tokens, fewer than '
     r'data\.seq_len \+ 1 = \d+; lower data\.seq_len or prepare it with a larger --val_fraction'),
    ('intact', {'data.path': '/nonexistent/tokens'},
     r'config\.data\.path: /nonexistent/tokens is not a directory'),
])
def test_bad_datasets_are_named_with_their_fix(dataset_dir, tmp_path, how, overrides, message,
                                               devices):
  del devices
  path = _damaged(dataset_dir, tmp_path, how)
  if overrides.get('data.seq_len') == 'VAL':
    with open(os.path.join(path, 'metadata.json'), encoding='utf-8') as f:
      val_tokens = json.load(f)['splits']['val']['tokens']
    overrides = {**overrides, 'data.seq_len': val_tokens, 'model.max_len': val_tokens}
  workdir = tmp_path / 'run'
  with pytest.raises(ZooError, match=message):
    train.train_and_evaluate(_config(path, **overrides), str(workdir))
  assert not workdir.exists()


def test_a_larger_model_vocabulary_is_allowed(dataset_dir, devices):
  del devices
  t = _trainer(dataset_dir, **{'model.vocab_size': 300})
  assert t.model.vocab_size == 300 and np.isfinite(t.run(1)[0])


def test_unknown_dataset_name_lists_tokens_and_records():
  from zoo.run import config as cfg  # pylint: disable=import-outside-toplevel
  with pytest.raises(ConfigError, match=r"unknown dataset 'tokenz'; known: .*tokens, records"):
    cfg.validate(load_config('char_lm', **{'data.name': 'tokenz'}), 8)


def test_sampling_encodes_and_decodes_with_the_datasets_tokenizer(dataset_dir, tmp_path,
                                                                   monkeypatch, devices):
  """A byte-level model continues a prompt with characters a character model never saw."""
  del devices
  from zoo.run import sampling  # pylint: disable=import-outside-toplevel
  workdir = str(tmp_path / 'run')
  # This file's run stopped (as by SIGTERM) after 2 steps, so its programs compile once: a
  # nearly random model, whose greedy bytes vary (12 steps: 'the the the ').
  stop_at(monkeypatch, 2)
  train.train_and_evaluate(_config(dataset_dir, **STRAIGHT), workdir)
  prompt, num_tokens = 'caf\u00e9 \u2603 ', 20  # 10 bytes + 20 <= max_len 32: the cache.
  [greedy] = sampling.generate(workdir, [prompt], num_tokens, temperature=0.0)
  assert greedy['prompt_ids'] == list(prompt.encode('utf-8'))  # Byte tokens: ids are bytes.
  assert len(greedy['ids']) == num_tokens and greedy['sample'] == prompt + greedy['text']
  assert len(set(greedy['ids'])) > 5, greedy['ids']  # Varied enough to compare meshes.
  for mesh_shape in ('1,8', '4,2'):
    assert sampling.generate(workdir, [prompt], num_tokens, temperature=0.0,
                           mesh_shape=mesh_shape) == [greedy]


def test_the_bpe_experiment_trains_on_a_token_dataset(tmp_path, devices):
  """experiments/bpe_lm.py:smoke on a BPE dataset prepared from these documents."""
  del devices
  path = str(tmp_path / 'bpe')
  result = prepare(path, '--vocab_size=300', tokenizer='bpe')
  assert result.returncode == 0, result.stderr[-2000:]
  config = load_config('bpe_lm', **{'data.path': path, 'mesh.shape': (4, 2),
                                     'train.log_every_steps': 1})
  train.train_and_evaluate(config, str(tmp_path / 'run'))
  rows = read_metrics(str(tmp_path / 'run'))
  losses = [r['train/loss'] for r in rows if 'train/loss' in r]
  assert losses[-1] < 0.8 * losses[0] and rows[-1]['eval/bits_per_byte'] < 8
  with open(tmp_path / 'run' / 'model_info.json', encoding='utf-8') as f:
    shapes = {p['path']: p['shape'] for p in json.load(f)['params']}
  assert shapes['embed'][0] == 384  # 300 tokens, padded to a multiple of 128.


def test_windows_across_shards_and_uint32_tokens(tmp_path):
  """Windows read across shard boundaries equal the concatenated tokens; a vocabulary of
  more than 65,536 ids is stored and read as uint32."""
  import tokenizers as hf  # pylint: disable=import-outside-toplevel
  from zoo.data import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
  big = tokenizer_lib.bytes_tokenizer()
  big.add_tokens([f'<word{i}>' for i in range(70_000)])  # Ids up to 70,256.
  big.save(str(tmp_path / 'big.json'))
  documents = [d + f' <word{i * 1000}> <word69999>' for i, d in enumerate(DOCUMENTS)]
  for name, tokenizer in (('small', 'bytes'), ('wide', str(tmp_path / 'big.json'))):
    result = prepare(str(tmp_path / name), '--shard_tokens=97', documents=documents,
                     tokenizer=tokenizer)
    assert result.returncode == 0, result.stderr[-2000:]
    meta = tokens.read_metadata(str(tmp_path / name))
    assert meta['dtype'] == ('<u4' if name == 'wide' else '<u2')
    split = tokens.TokenSplit(str(tmp_path / name), 'train', meta)
    assert len(split.shards) == -(-split.tokens // 97) > 10
    whole = np.concatenate([np.fromfile(tmp_path / name / s['file'], meta['dtype'])
                            for s in meta['splits']['train']['shards']])
    positions = np.array([0, 90, 96, 97, 150, split.tokens - 300])  # Inside, at and across edges.
    np.testing.assert_array_equal(split.windows(positions, 300),
                                  whole[positions[:, None] + np.arange(300)])
  assert hf.Tokenizer.from_file(str(tmp_path / 'big.json')).token_to_id('<word69000>') > 65_536
  assert whole.max() > 65_536  # The wide dataset's ids really needed 32 bits.


def test_a_plan_takes_splits_shorter_than_one_window(dataset_dir):
  """A pod plan needs only the shapes: packed documents shorter than data.seq_len load for a
  plan (one padded window each split), a stream repeats its split to fill each window; both
  are refused, in one line, for training."""
  with open(os.path.join(dataset_dir, 'metadata.json'), encoding='utf-8') as f:
    train_tokens = json.load(f)['splits']['train']['tokens']
  config = _config(dataset_dir, **{'data.seq_len': 2 * train_tokens})
  planned = data.load(config.data, 0, plan=True)
  row = planned.train_batch(0, 1, slice(0, 1))
  assert row['inputs'].shape == row['segments'].shape == (1, 2 * train_tokens)
  assert row['mask'].sum() == train_tokens  # The whole split, then padding.
  with pytest.raises(ConfigError, match=rf'^config\.data\.seq_len: {2 * train_tokens} is longer '
                     rf'than the {train_tokens} tokens of the train split'):
    data.load(config.data, 0)
  config.data.windows = 'stream'
  planned = data.load(config.data, 0, plan=True)
  rows, evals = planned.train_batch(0, 2, slice(0, 2)), next(planned.eval_batches(2, slice(0, 2)))
  assert rows['inputs'].shape == evals['targets'].shape == (2, 2 * train_tokens)
  np.testing.assert_array_equal(rows['inputs'][:, train_tokens:], rows['inputs'][:, :train_tokens])
  with pytest.raises(ConfigError, match=r'^config\.data\.path: the train split of .* has '
                     rf'{train_tokens} tokens, fewer than data\.seq_len \+ 1'):
    data.load(config.data, 0)
