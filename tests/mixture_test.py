"""Weighted mixtures (data.sources, data.weights): each source's exact share of every block,
batches that are a function of (seed, step, rows) on any process count, each process
reading only its rows' sources, a held-out source never trained on, and eval per source
equal to each source evaluated alone."""
import dataclasses
import json

import numpy as np
import pytest

from conftest import load_config, trainer
from zoo import data
from zoo.data import mixture, tokens
from zoo.data import tokenizer as tokenizer_lib
from zoo.errors import ZooError
from zoo.run import config as cfg
from zoo.run import train

SEQ = 32


def _prepare(root, name, text, tokenizer=None):
  rng = np.random.default_rng(len(name))
  docs = [''.join(rng.choice(list(text), int(n))) for n in rng.integers(5, 90, 40)]
  (root / f'{name}.jsonl').write_text(''.join(json.dumps({'text': d}) + '\n' for d in docs))
  (root / name).mkdir()
  tokens.prepare([str(root / f'{name}.jsonl')], str(root / name),
                 tokenizer or tokenizer_lib.bytes_tokenizer(), val_fraction=0.2)
  return str(root / name)


@pytest.fixture(scope='module')
def sources(tmp_path_factory):
  root = tmp_path_factory.mktemp('mixture')
  return {'web': _prepare(root, 'web', 'abcdefgh '), 'code': _prepare(root, 'code', '(){}=;x\n'),
          'books': _prepare(root, 'books', 'ABCDEFGH. '),
          'other_tokenizer': _prepare(root, 'bpe', 'abcdefgh ', tokenizer_lib.train_bpe(
              iter(['abcdefgh ' * 50]), 300))}


def _config(sources, weights, **overrides):
  return load_config('char_lm', **{
      'data.name': 'tokens', 'data.seq_len': SEQ, 'model.max_len': SEQ, 'mesh.shape': (4, 2),
      'data.sources': {k: sources[k] for k in ('web', 'code', 'books')}, 'data.weights': weights,
      **overrides})


def test_each_block_holds_each_sources_share_and_every_example_once():
  assign = mixture.Assignment([0.5, 0.3, 0.2, 0.0], seed=3, block=100)
  source, local = assign(np.arange(1000))
  np.testing.assert_array_equal(np.bincount(source.reshape(10, 100)[4], minlength=4), [50, 30, 20, 0])
  for j, share in enumerate([500, 300, 200]):  # Each source's own stream, in order, none skipped.
    np.testing.assert_array_equal(np.sort(local[source == j]), np.arange(share))
  again, local_again = mixture.Assignment([0.5, 0.3, 0.2, 0.0], seed=3, block=100)(
      np.arange(999, 99, -1))  # Fresh, and asked out of order.
  np.testing.assert_array_equal(again[::-1], source[100:])
  np.testing.assert_array_equal(local_again[::-1], local[100:])
  assert not np.array_equal(mixture.Assignment([0.5, 0.3, 0.2, 0.0], 4, 100)(np.arange(100))[0],
                            source[:100])
  np.testing.assert_array_equal(mixture.shares([1 / 3] * 3, 100), [34, 33, 33])


def test_batches_are_exact_on_any_process_count_and_read_only_their_sources(sources,
                                                                            monkeypatch):
  """The global batch of a step is the same whether one process builds it or four build a
  quarter each (fresh datasets: nothing but the step carries over); a process reads
  windows only of the sources its rows come from, and the held-out source (weight 0) none."""
  config = _config(sources, {'web': 0.6, 'code': 0.4, 'books': 0.0})
  want = data.load(config.data, 0).train_batch(7, 64, slice(None))
  assert set(want) == {'inputs', 'targets', 'segments', 'positions', 'mask'}
  reads = []
  original = tokens.TokenSource.train_rows
  def counted(self, positions):
    reads.append((self.path, len(positions)))
    return original(self, positions)
  monkeypatch.setattr(tokens.TokenSource, 'train_rows', counted)
  shares = mixture.weights(config.data)  # In the sources' order: books, code, web.
  assert list(shares) == ['books', 'code', 'web']
  source_of_row, _ = mixture.Assignment(list(shares.values()), 0)(7 * 64 + np.arange(64))
  paths = [sources[name] for name in shares]
  parts = []
  for rows in (slice(0, 16), slice(16, 32), slice(32, 48), slice(48, 64)):
    reads.clear()
    dataset = data.load(config.data, 0)
    parts.append(dataset.train_batch(7, 64, rows))
    assert dataset.examples_read() == 16
    assert dict(reads) == {paths[j]: int(n) for j, n in enumerate(
        np.bincount(source_of_row[rows], minlength=3)) if n}
  for key in want:
    np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), want[key])
  code = np.isin(want['targets'], [ord(c) for c in '(){}=;x\n']).any(1)  # Its own alphabet.
  np.testing.assert_array_equal(code, source_of_row == 1)
  assert 0.3 < (source_of_row == 1).mean() < 0.5
  assert not np.isin(want['targets'], [ord(c) for c in 'ABCDEFGH.']).any()  # Held out.


def test_eval_reports_each_source_as_if_alone_and_all_together(sources, devices):
  """eval/<source>/... equal evaluating that source's own dataset with the same state; the
  held-out source is reported; eval/loss lies between the sources'."""
  del devices
  t = trainer('char_lm', **{
      'data.name': 'tokens', 'data.seq_len': SEQ, 'model.max_len': SEQ, 'mesh.shape': (4, 2),
      'data.sources': {k: sources[k] for k in ('web', 'code', 'books')},
      'data.weights': {'web': 0.6, 'code': 0.4, 'books': 0.0}, 'eval.max_batches': 0, 'model.d_model': 32,
      'model.num_heads': 4, 'model.mlp_dim': 64})
  t.run(10)
  result = train.evaluate(t.eval_step, t.state, t.setup)
  losses = []
  for name in ('web', 'code', 'books'):
    alone = dataclasses.replace(t.setup, dataset=data.load(
        load_config('char_lm', **{'data.name': 'tokens', 'data.path': sources[name],
                                  'data.seq_len': SEQ}).data, 0))
    want = train.evaluate(t.eval_step, t.state, alone)
    for metric in ('loss', 'accuracy', 'bits_per_byte'):
      assert result[f'eval/{name}/{metric}'] == pytest.approx(want[f'eval/{metric}'], rel=1e-5)
    losses.append(want['eval/loss'])
  assert min(losses) < result['eval/loss'] < max(losses)


@pytest.mark.parametrize('overrides,message', [
    ({'data.weights': {'web': 0.5, 'code': 0.5}}, r"config\.data\.weights: has no weight for "
                                                  r"source 'books'; give one \(0: evaluated only\)"),
    ({'data.weights': {'web': 1, 'code': 1, 'books': 1, 'news': 1}},
     r'config\.data\.weights\.news: names no source; the sources are books, code, web'),
    ({'data.weights': (0.5, 0.5, 0.0)}, r'config\.data\.weights: is a list, but data\.sources is '
                                        r'a dict, which keeps no order'),
    ({'data.sources': 'LIST', 'data.weights': (0.5, 0.5)},
     r'config\.data\.weights: has 2 weights for the 3 sources \(web, code, books\)'),
    ({'data.sources': 'LIST', 'data.weights': (0.5, -1.0, 0.0)},
     r"config\.data\.weights: the weight of 'code' must be a finite number >= 0, got -1\.0"),
    ({'data.weights': {'web': 0, 'code': 0, 'books': 0}}, r'config\.data\.weights: are all 0'),
    ({'data.path': '/some/where'}, r"config\.data\.path: '/some/where' and data\.sources are both "
                                   r'set'),
    ({'data.sources.code': '/nonexistent'}, r'config\.data\.sources\.code: /nonexistent is not a '
                                            r'directory'),
    ({'data.sources.code': 'OTHER'}, r'config\.data\.sources\.code: .* was prepared with another '
                                     r"tokenizer than 'books'; prepare it again with "
                                     r'--tokenizer=.*/books/tokenizer\.json'),
])
def test_bad_mixtures_are_one_line_naming_the_field(sources, tmp_path, overrides, message):
  config = _config(sources, {'web': 0.5, 'code': 0.3, 'books': 0.2})
  for key, value in overrides.items():
    if isinstance(value, str):
      value = {'OTHER': sources['other_tokenizer'],
               'LIST': tuple(sources[k] for k in ('web', 'code', 'books'))}.get(value, value)
    node, leaf = config, key.split('.')
    for part in leaf[:-1]:
      node = node[part]
    with node.ignore_type():
      node[leaf[-1]] = value
  workdir = tmp_path / 'run'
  with pytest.raises(ZooError, match=message):
    train.train_and_evaluate(config, str(workdir))
  assert not workdir.exists()


def test_a_mixture_validates_like_any_config(sources):
  cfg.validate(_config(sources, {'web': 2, 'code': 1, 'books': 0}), 8)
