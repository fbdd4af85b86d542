"""Record datasets: images from an image-folder tree, decoded and augmented per process, the
same batches with any number of workers, exact resume, and damaged records named."""
import json
import os
import shutil

import numpy as np
import pytest

from conftest import load_config, read_metrics, stop_at
from zoo import data
from zoo.data import digits, records, writer
from zoo.errors import ConfigError
from zoo.run import train


@pytest.fixture(scope='module')
def prepared(tmp_path_factory):
  """The bundled digits as PNG files (train/ and val/ as the in-memory split), prepared as
  pixels (what --store=auto keeps for 8x8 images) and as the PNG files."""
  root = tmp_path_factory.mktemp('records')
  digits.write_image_folder(str(root / 'png'))
  for store in ('auto', 'file'):  # zoo.prepare's writer, in this process.
    writer.run('images', writer.Options(inputs=(str(root / 'png'),), output=str(root / store),
                                        store=store))
  return {'pixels': str(root / 'auto'), 'file': str(root / 'file')}


@pytest.fixture(scope='module')
def dataset_dir(prepared):
  return prepared['pixels']


def _config(path, **overrides):
  return load_config('cnn_digits', **{'data.name': 'records', 'data.path': path,
                                      'mesh.shape': (4, 2), **overrides})


@pytest.mark.parametrize('store', ['pixels', 'file'])
def test_the_records_hold_the_in_memory_digits(prepared, store):
  dataset_dir = prepared[store]
  with open(os.path.join(dataset_dir, 'metadata.json'), encoding='utf-8') as f:
    meta = json.load(f)
  assert meta['classes'] == [str(d) for d in range(10)] and meta['image_shape'] == [8, 8, 1]
  assert meta['encoding'] == store
  assert [meta['splits'][s]['examples'] for s in ('train', 'val')] == [1437, 360]
  memory = data.load(load_config('cnn_digits').data, 0)
  files = data.load(_config(dataset_dir).data, 0)
  a, b = next(memory.eval_batches(360, slice(None))), next(files.eval_batches(360, slice(None)))
  pixels = b['inputs'][..., 0] * meta['std'][0] + meta['mean'][0]  # Undo the normalisation.
  def examples(images, labels):  # (label, image in 1/16ths): the same set, in class order.
    return sorted((int(y), np.round(x * 16).astype(int).tobytes()) for x, y in zip(images, labels))
  assert examples(pixels, b['targets']) == examples(a['inputs'][..., 0], a['targets'])


def test_batches_are_a_function_of_seed_step_and_row_with_any_workers(dataset_dir):
  augmented = _config(dataset_dir, **{'data.augment': 'crop,flip'})
  dataset = data.load(augmented.data, 5)
  full = dataset.train_batch(3, 32, slice(None))
  halves = [dataset.train_batch(3, 32, slice(0, 16)), dataset.train_batch(3, 32, slice(16, 32))]
  for key in ('inputs', 'targets'):
    np.testing.assert_array_equal(np.concatenate([h[key] for h in halves]), full[key])
  plain = data.load(_config(dataset_dir).data, 5).train_batch(3, 32, slice(None))
  np.testing.assert_array_equal(plain['targets'], full['targets'])  # Same examples ...
  assert not np.array_equal(plain['inputs'], full['inputs'])  # ... cropped and flipped.
  augmented.data.workers = 2
  iterator = data.load(augmented.data, 5).train_iterator(2, 32, slice(None))
  try:
    for step in (2, 3, 4):
      batch = next(iterator)
      want = dataset.train_batch(step, 32, slice(None))
      for key in ('inputs', 'targets'):
        np.testing.assert_array_equal(batch[key], want[key])
  finally:
    iterator.close()


def test_trains_to_the_in_memory_accuracy_and_resumes_exactly(dataset_dir, tmp_path, monkeypatch,
                                                             devices):
  """The smoke CNN on the records (2 decoding workers) and on the in-memory digits; a run
  stopped mid-epoch (an epoch is 11 steps of 128) resumes bit-identically. The stopped run
  decodes in the loop, its continuation in 2 workers that start at the resumed step: the
  straight run's batches either way."""
  del devices
  overrides = {'train.log_every_steps': 1, 'data.workers': 2}
  train.train_and_evaluate(_config(dataset_dir, **overrides), str(tmp_path / 'straight'))
  train.train_and_evaluate(load_config('cnn_digits', **{'mesh.shape': (4, 2)}),
                           str(tmp_path / 'memory'))
  files, memory = (read_metrics(str(tmp_path / d))[-1] for d in ('straight', 'memory'))
  assert files['eval/accuracy'] > 0.7 and abs(files['eval/accuracy'] - memory['eval/accuracy']) < 0.1
  stop_at(monkeypatch, 16)
  train.train_and_evaluate(_config(dataset_dir, **{**overrides, 'data.workers': 0}),
                           str(tmp_path / 'resumed'))
  monkeypatch.undo()
  train.train_and_evaluate(_config(dataset_dir, **overrides), str(tmp_path / 'resumed'))
  rows = lambda d: [{k: v for k, v in r.items() if not k.startswith('perf/')}
                    for r in read_metrics(str(tmp_path / d))]
  assert rows('resumed') == rows('straight')


@pytest.mark.parametrize('store,cause', [('file', r'cannot be decoded \(UnidentifiedImageError'),
                                         ('pixels', r'holds 12 bytes of pixels, not 8x8x1')])
def test_a_record_that_does_not_decode_is_named_with_its_file(prepared, store, cause, tmp_path,
                                                              devices):
  """A record whose image bytes are damaged after prepare: the shard and index are named."""
  del devices
  from array_record.python import array_record_module  # pylint: disable=import-outside-toplevel
  path = str(tmp_path / 'damaged')
  shutil.copytree(prepared[store], path)
  source = records.Reader(path, records.read_metadata(path), 'train')
  source.batch(np.arange(1))  # Opens the file.
  all_records = source._source.__getitems__(list(range(source.size)))  # pylint: disable=protected-access
  all_records[5] = all_records[5][:4] + b'not an image'
  writer = array_record_module.ArrayRecordWriter(os.path.join(path, 'train-00000.array_record'),
                                                 'group_size:1')
  for r in all_records:
    writer.write(r)
  writer.close()
  step = next(s for s in range(20) if 5 in records.epoch_order(0, 1437, s, 128))
  message = r'config\.data\.path: record 5 of .*train-00000\.array_record ' + cause
  with pytest.raises(ConfigError, match=message):
    data.load(_config(path).data, 0).train_batch(step, 128, slice(None))
  workers = _config(path, **{'data.workers': 1}).data
  batches = data.load(workers, 0).train_iterator(step, 128, slice(None))
  try:  # The same error, raised in a grain worker, reaches the loop as the same ConfigError.
    with pytest.raises(ConfigError, match=message):
      next(batches)
  finally:
    batches.close()


@pytest.mark.parametrize('overrides,message', [
    ({'data.augment': 'rotate'}, r"config\.data\.augment: unknown augmentation 'rotate'; known: crop, flip"),
    ({'data.workers': -1}, r'config\.data\.workers: must be >= 0'),
    ({'data.path': ''}, r'config\.data\.path: is empty'),
])
def test_bad_record_settings(dataset_dir, overrides, message, tmp_path, devices):
  del devices
  with pytest.raises(ConfigError, match=message):
    train.train_and_evaluate(_config(dataset_dir, **overrides), str(tmp_path / 'run'))
  assert not (tmp_path / 'run').exists()


@pytest.mark.parametrize('how,message', [
    ('version', r'config\.data\.path: .* was prepared by format version 7, but this zoo reads '
                r'version 1 or 2; prepare it again'),
    ('missing', r'config\.data\.path: record file .*val-00000\.array_record is missing'),
    ('truncated', r'config\.data\.path: record file .*train-00000\.array_record (holds \d+ '
                  r'records, but 1437 were written|is damaged \(.*\)); prepare the dataset again'),
    ('tokens', r"config\.data\.path: .* holds 'zoo\.tokens' data, not 'zoo\.records'; give a "
               r"directory that `python -m zoo\.prepare images` wrote"),
])
def test_bad_record_datasets_are_named_with_their_fix(dataset_dir, how, message, tmp_path, devices):
  del devices
  path = tmp_path / 'damaged'
  shutil.copytree(dataset_dir, path)
  meta = json.loads((path / 'metadata.json').read_text())
  if how == 'missing':
    os.remove(path / 'val-00000.array_record')
  elif how == 'truncated':
    os.truncate(path / 'train-00000.array_record', os.path.getsize(path / 'train-00000.array_record') // 2)
  else:
    meta.update({'version': 7} if how == 'version' else {'format': 'zoo.tokens'})
    (path / 'metadata.json').write_text(json.dumps(meta))
  with pytest.raises(ConfigError, match=message):
    train.train_and_evaluate(_config(str(path)), str(tmp_path / 'run'))
  assert not (tmp_path / 'run').exists()
