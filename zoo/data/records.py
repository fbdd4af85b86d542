"""Record datasets: labelled images in ArrayRecord files, decoded and augmented per process.

`data.name = 'records'`, `data.path = DIR`, a directory that `python -m zoo.prepare images`
wrote from an image-folder tree (ROOT/train/<class>/*.png|jpg, optional ROOT/val/<class>/):

    metadata.json               format and version, class names, image shape, the training
                                images' per-channel mean and std, per split: examples, shards
    train-00000.array_record    one record per image: its label (4 bytes, little-endian)
    val-00000.array_record      and its pixels (H x W x C uint8, `encoding: pixels`) or its
                                PNG or JPEG file's bytes (`encoding: file`)

`zoo.prepare images --store=auto` keeps pixels for images of at most PIXELS_MAX_BYTES
(the digits, CIFAR-sized images): decoding a small PNG costs more than its bytes save, and
a pixel record needs no decoding at all. Larger images keep their compressed files,
decoded when read.

Records are read through grain's random-access ArrayRecordDataSource, only the rows of each
global batch that this process holds. Training batches follow zoo's epoch order, a pure
function of (seed, step); `data.augment` ('crop', 'flip' or 'crop,flip') draws each row's
crop and flip from (seed, step, row). Decoding and augmentation run in `data.workers` grain
worker processes (0: in the loop's prefetch thread), which build whole batches ahead in step
order, so the batches and a resumed run's are the same with any number of workers. Eval
batches (no augmentation) are decoded in the loop, where starting workers would cost more
than they save for a validation split; cap large ones with eval.max_batches.
"""
import concurrent.futures
import dataclasses
import io
import json
import math
import os
import signal
import sys
from typing import Any, Callable, Iterator, Optional

from absl import logging
import ml_collections
import numpy as np

from zoo.data import dataset, tokens
from zoo.data.dataset import DataSource, Dataset, epoch_order, padded_rows
from zoo.errors import ConfigError, fail
from zoo.store import storage

FORMAT, VERSION = 'zoo.records', 2  # 2 added `encoding`; 1 is 'file'.
STORES = ('auto', 'pixels', 'file')
PIXELS_MAX_BYTES = 64 * 64 * 3  # --store=auto keeps pixels up to this size of an image.
METADATA = dataset.METADATA
SPLITS = ('train', 'val')
IMAGE_EXTENSIONS = ('.png', '.jpg', '.jpeg')
AUGMENTATIONS = ('crop', 'flip')
MAX_WORKERS = 256  # Decoding processes: more would only exhaust the host's memory.


# Preparing: an image-folder tree -> record files.

@dataclasses.dataclass
class Plan:
  """What `prepare` writes, from `plan`: every image checked, the statistics computed."""
  root: str
  classes: list
  examples: dict            # split -> [(path, label)]
  image_shape: tuple        # (height, width, channels), the same for every image.
  image_size: int           # > 0: images are resized and centre-cropped to this square.
  mean: list
  std: list
  encoding: str = 'file'    # What a record holds: 'pixels' (uint8 H x W x C) or 'file'.


def _image_files(directory: str) -> list[str]:
  return sorted(os.path.join(directory, f) for f in os.listdir(directory)
                if f.lower().endswith(IMAGE_EXTENSIONS))


def _scan(root: str, val_fraction: float, seed: int) -> tuple[list, dict]:
  train_root, val_root = os.path.join(root, 'train'), os.path.join(root, 'val')
  if not os.path.isdir(train_root):
    raise ConfigError(f'--input: {root} has no train/ folder; give an image-folder tree: '
                      'ROOT/train/<class>/*.png (and optionally ROOT/val/<class>/)')
  classes = sorted(d for d in os.listdir(train_root) if os.path.isdir(os.path.join(train_root, d)))
  if not classes:
    raise ConfigError(f'--input: {train_root} has no class folders; put each class\'s images in '
                      f'{train_root}/<class>/')
  examples = {'train': [], 'val': []}
  for label, name in enumerate(classes):
    files = _image_files(os.path.join(train_root, name))
    if not files:
      raise ConfigError(f'--input: class folder {os.path.join(train_root, name)} has no images '
                        f'({", ".join(IMAGE_EXTENSIONS)}); add some or remove the folder')
    examples['train'] += [(f, label) for f in files]
  if os.path.isdir(val_root):
    for name in sorted(os.listdir(val_root)):
      folder = os.path.join(val_root, name)
      if not os.path.isdir(folder):
        continue
      if name not in classes:
        raise ConfigError(f'--input: {folder} is a class that train/ does not have; remove it or '
                          f'add {os.path.join(train_root, name)}')
      examples['val'] += [(f, classes.index(name)) for f in _image_files(folder)]
  else:
    count = len(examples['train'])
    held_out = [tokens.in_validation(i, val_fraction, seed) for i in range(count)]
    if not any(held_out) and count > 1:  # A small tree: the split rounds up to one image.
      held_out[tokens.first_in_validation(count, seed)] = True
      logging.warning('no image of %d went to the val split at --val_fraction=%g: it holds one, '
                      'the split rounded up', count, val_fraction)
    examples['val'] = [e for e, h in zip(examples['train'], held_out) if h]
    examples['train'] = [e for e, h in zip(examples['train'], held_out) if not h]
  for split, fix in (('train', 'add images'), ('val', 'add ROOT/val/ or raise --val_fraction')):
    if not examples[split]:
      raise ConfigError(f'--input: the {split} split of {root} is empty; {fix}')
  return classes, examples


def _resized(image: Any, size: int) -> Any:
  """The shorter side scaled to `size`, then the centre size x size square."""
  from PIL import Image  # pylint: disable=import-outside-toplevel
  w, h = image.size
  scale = size / min(w, h)
  image = image.resize((max(size, round(w * scale)), max(size, round(h * scale))),
                       Image.Resampling.BICUBIC)
  left, top = (image.size[0] - size) // 2, (image.size[1] - size) // 2
  return image.crop((left, top, left + size, top + size))


def _inspect(path: str, image_size: int, train: bool) -> tuple:
  """(size, mode, per-channel sum and sum of squares in [0, 1] or None, pixels, error)."""
  from PIL import Image  # pylint: disable=import-outside-toplevel
  try:
    with Image.open(path) as image:
      image.load()
      mode = image.mode
      if image_size:
        image = _resized(image, image_size)
      sums = None
      if train:
        x = np.asarray(image.convert('RGB'), np.float64) / 255.0
        sums = (x.sum((0, 1)), (x * x).sum((0, 1)))
      return image.size, mode, sums, image.size[0] * image.size[1], None
  except Exception as e:  # pylint: disable=broad-except  # PIL raises many types.
    reason = str(e).splitlines()[0][:80] if str(e) else ''
    return None, None, None, 0, f'{path} ({type(e).__name__}: {reason})'


MAX_IMAGE_SIZE = 8192  # Pixels a side: 192 MiB an RGB image, as uint8.


def plan(root: str, val_fraction: float = 0.01, seed: int = 0, image_size: int = 0,
         progress_bar: Optional[Callable] = None, store: str = 'auto') -> Plan:
  """Scans and decodes every image once, on threads over the cores: ConfigError naming and
  counting the unreadable ones, or images of different sizes without `image_size`; the
  training images' mean and std per channel (in [0, 1]); what records will hold (`store`:
  'pixels', 'file', or 'auto': pixels for images of at most PIXELS_MAX_BYTES)."""
  if store not in STORES:
    raise ConfigError(f'--store: unknown {store!r}; known: {", ".join(STORES)}')
  if not 0 <= image_size <= MAX_IMAGE_SIZE:
    raise ConfigError(f'--image_size: must be in [1, {MAX_IMAGE_SIZE}] pixels (0: keep the sizes), '
                      f'got {image_size}')
  classes, examples = _scan(root, val_fraction, seed)
  everything = [(p, True) for p, _ in examples['train']] + [(p, False) for p, _ in examples['val']]
  bar = progress_bar(len(everything), 'checking images', unit='img') if progress_bar else None
  shapes, modes, bad = {}, set(), []
  total, total_sq, pixels = np.zeros(3), np.zeros(3), 0
  with concurrent.futures.ThreadPoolExecutor(os.cpu_count()) as pool:
    checked = (result for start in range(0, len(everything), 4096)  # Bounded queue of work.
               for result in pool.map(lambda item: _inspect(item[0], image_size, item[1]),
                                      everything[start:start + 4096]))
    for (path, _), (size, mode, sums, count, error) in zip(everything, checked):
      if error:
        bad.append(error)
      else:
        modes.add(mode)
        shapes.setdefault(size, path)
        if sums is not None:
          total, total_sq, pixels = total + sums[0], total_sq + sums[1], pixels + count
      if bar is not None:
        bar.update(1)
  if bar is not None:
    bar.close()
  if bad:
    more = '; ...' if len(bad) > 5 else ''
    raise ConfigError(f'--input: {len(bad)} of {len(everything)} images cannot be read: '
                      f'{"; ".join(bad[:5])}{more}; remove or replace them')
  if len(shapes) > 1:
    (size_a, path_a), (size_b, path_b) = list(shapes.items())[:2]
    raise ConfigError(f'--input: images differ in size ({path_a}: {size_a[0]}x{size_a[1]}, '
                      f'{path_b}: {size_b[0]}x{size_b[1]}); give --image_size=N to resize them')
  gray = modes <= {'1', 'L', 'I', 'I;16', 'F'}
  mean = total / pixels
  std = np.sqrt(np.maximum(total_sq / pixels - mean * mean, 1e-12))
  if gray:  # All channels are equal: keep one.
    mean, std = mean[:1], std[:1]
  (width, height), = shapes
  shape = (height, width, 1 if gray else 3)
  if store == 'auto':
    store = 'pixels' if math.prod(shape) <= PIXELS_MAX_BYTES else 'file'
  return Plan(root, classes, examples, shape, image_size, [float(m) for m in mean],
              [float(s) for s in std], store)


def _encoded(path: str, p: Plan) -> bytes:
  """What a record holds after its label: the image's pixels, or its file (resized to
  p.image_size, if given, in the file's own format)."""
  image_size = p.image_size
  with open(path, 'rb') as f:
    data = f.read()
  from PIL import Image  # pylint: disable=import-outside-toplevel
  if p.encoding == 'pixels':
    with Image.open(io.BytesIO(data)) as image:
      image = _resized(image, image_size) if image_size else image
      pixels = np.asarray(image.convert('L' if p.image_shape[2] == 1 else 'RGB'), np.uint8)
    return pixels.reshape(p.image_shape).tobytes()
  if not image_size:
    return data  # The file as it is: decoding happens at training time.
  with Image.open(io.BytesIO(data)) as image:
    fmt = 'JPEG' if image.format == 'JPEG' else 'PNG'
    out = io.BytesIO()
    _resized(image, image_size).save(out, format=fmt, **({'quality': 95} if fmt == 'JPEG' else {}))
  return out.getvalue()


def prepare(p: Plan, directory: str, shard_examples: int = 4096,
            progress_bar: Optional[Callable] = None) -> dict:
  """Writes the planned records into `directory` (existing, empty); returns the metadata,
  written last."""
  from array_record.python import array_record_module  # pylint: disable=import-outside-toplevel
  if shard_examples <= 0:
    raise ConfigError(f'--shard_examples: must be positive, got {shard_examples}')
  count = sum(len(v) for v in p.examples.values())
  bar = progress_bar(count, 'writing records', unit='img') if progress_bar else None
  splits = {}
  for split in SPLITS:
    shards = []
    for start in range(0, len(p.examples[split]), shard_examples):
      chunk = p.examples[split][start:start + shard_examples]
      name = f'{split}-{len(shards):05d}.array_record'
      writer = array_record_module.ArrayRecordWriter(os.path.join(directory, name), 'group_size:1')
      for path, label in chunk:
        writer.write(int(label).to_bytes(4, 'little') + _encoded(path, p))
        if bar is not None:
          bar.update(1)
      writer.close()
      shards.append({'file': name, 'examples': len(chunk)})
    splits[split] = {'examples': len(p.examples[split]), 'shards': shards}
  if bar is not None:
    bar.close()
  meta = {'format': FORMAT, 'version': VERSION, 'classes': p.classes,
          'image_shape': list(p.image_shape), 'image_size': p.image_size, 'mean': p.mean,
          'std': p.std, 'encoding': p.encoding, 'root': os.path.abspath(p.root),
          'splits': splits}
  with open(os.path.join(directory, METADATA), 'w', encoding='utf-8') as f:
    json.dump(meta, f, indent=2)
  return meta


def describe(meta: dict) -> str:
  h, w, c = meta['image_shape']
  return (f'{len(meta["classes"])} classes, {h}x{w}x{c} images; '
          + '; '.join(f'{s}: {meta["splits"][s]["examples"]:,} images in '
                      f'{len(meta["splits"][s]["shards"])} files' for s in SPLITS))


# Reading: record files -> batches.

def read_metadata(path: str) -> dict:
  """The dataset's metadata, once every record file it names is there."""
  from array_record.python import array_record_module  # pylint: disable=import-outside-toplevel
  if storage.is_remote(path):  # ArrayRecord (through grain) opens local files only.
    raise ConfigError(f'config.data.path: {path}: record datasets are read by ArrayRecord, which '
                      'opens local files only; mount the bucket on every host with gcsfuse '
                      '(gcsfuse --implicit-dirs BUCKET /mnt/BUCKET) and give the mounted path')
  meta = dataset.read_metadata(path, FORMAT, (1, VERSION), 'images')
  meta.setdefault('encoding', 'file')  # Version 1 kept files.
  for split in SPLITS:
    for shard in meta['splits'][split]['shards']:
      file = os.path.join(path, shard['file'])
      if not os.path.isfile(file):
        raise ConfigError(f'config.data.path: record file {file} is missing; prepare the dataset '
                          'again')
      try:  # Reads the file's index: a truncated or damaged file fails here, not mid-run.
        reader = array_record_module.ArrayRecordReader(file)
        count = reader.num_records()
        reader.close()
      except Exception as e:  # pylint: disable=broad-except  # array_record raises several types.
        raise ConfigError(f'config.data.path: record file {file} is damaged ({type(e).__name__}: '
                          f'{str(e)[:100]}); prepare the dataset again') from None
      if count != shard['examples']:
        raise ConfigError(f'config.data.path: record file {file} holds {count} records, but '
                          f'{shard["examples"]} were written; prepare the dataset again')
  return meta


class Reader:
  """Decodes (and augments) records of one split into float32 images and int32 labels.

  Picklable: grain workers receive it and open the record files themselves. Counts the
  records this process read.
  """

  def __init__(self, path: str, meta: dict, split: str, augment: tuple = ()):
    self.files = [os.path.join(path, s['file']) for s in meta['splits'][split]['shards']]
    self.starts = np.cumsum([0] + [s['examples'] for s in meta['splits'][split]['shards']])
    self.size = int(self.starts[-1])
    self.shape = tuple(meta['image_shape'])
    self.mean = np.asarray(meta['mean'], np.float32)
    self.std = np.asarray(meta['std'], np.float32)
    self.augment = tuple(augment)
    self.pixels = meta.get('encoding') == 'pixels'
    self.records_read = 0
    self._source = None

  def __getstate__(self):
    return {**self.__dict__, '_source': None}

  def _where(self, index: int) -> str:
    shard = int(np.searchsorted(self.starts, index, side='right')) - 1
    return f'record {index - self.starts[shard]} of {self.files[shard]}'

  def _decode(self, index: int, record: bytes) -> np.ndarray:
    h, w, c = self.shape
    if self.pixels:
      if len(record) != 4 + h * w * c:
        raise ConfigError(f'config.data.path: {self._where(index)} holds {len(record) - 4} bytes '
                          f'of pixels, not {h}x{w}x{c}; prepare the dataset again')
      return np.frombuffer(record, np.uint8, offset=4).reshape(h, w, c)
    from PIL import Image  # pylint: disable=import-outside-toplevel
    try:
      with Image.open(io.BytesIO(record[4:])) as image:
        return np.asarray(image.convert('L' if c == 1 else 'RGB'), np.uint8).reshape(h, w, c)
    except Exception as e:  # pylint: disable=broad-except  # PIL raises many types.
      raise ConfigError(f'config.data.path: {self._where(index)} cannot be decoded '
                        f'({type(e).__name__}: {e}); prepare the dataset again') from None

  def batch(self, indices: np.ndarray, crops: Optional[np.ndarray] = None,
            flips: Optional[np.ndarray] = None) -> dict:
    """Images [n, H, W, C] (uint8: what workers send is a quarter of float32's bytes; see
    `normalize`) and labels [n] of the records `indices`; with `crops` [n, 2] (top, left
    offsets into the image padded by 1/8 of a side) and `flips` [n] (mirror or not),
    augmented, all rows at once."""
    if self._source is None:
      import grain  # pylint: disable=import-outside-toplevel
      self._source = grain.sources.ArrayRecordDataSource(self.files)
    records = self._source.__getitems__([int(i) for i in indices])
    self.records_read += len(records)
    h, w, _ = self.shape
    x = np.stack([self._decode(int(i), r) for i, r in zip(indices, records)])
    n = np.arange(len(x))[:, None, None]
    if crops is not None:
      pad = crop_padding(h)
      x = np.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
      x = x[n, crops[:, :1, None] + np.arange(h)[None, :, None],
            crops[:, 1:, None] + np.arange(w)[None, None, :]]
    if flips is not None:
      x = np.where(flips[:, None, None, None], x[:, :, ::-1], x)
    labels = [int.from_bytes(r[:4], 'little') for r in records]
    return {'inputs': x, 'targets': np.asarray(labels, np.int32)}

  def normalize(self, batch: dict) -> dict:
    """uint8 images -> float32, by the training images' per-channel mean and std."""
    return {**batch, 'inputs': (batch['inputs'] * np.float32(1 / 255.0) - self.mean) / self.std}


def crop_padding(side: int) -> int:
  """'crop' pads each side by 1/8 of it (at least 1 pixel) and crops back at random."""
  return max(1, side // 8)


class TrainBatch:
  """step -> this process's rows of the global train batch (picklable, for grain workers).

  The examples follow zoo's epoch order; the crops and flips of the whole global batch are
  drawn from (seed, step), and each process takes its rows: a function of (seed, step, row).
  """

  def __init__(self, reader: Reader, seed: int, global_batch_size: int, rows: slice):
    self.reader, self.seed, self.size, self.rows = reader, seed, global_batch_size, rows

  def __call__(self, step: int) -> dict:
    indices = epoch_order(self.seed, self.reader.size, step, self.size)[self.rows]
    crops = flips = None
    if self.reader.augment:
      rng = np.random.default_rng([self.seed, step, 1])  # Apart from epoch_order's [seed, epoch].
      offsets = rng.integers(0, 2 * crop_padding(self.reader.shape[0]) + 1, size=(self.size, 2))
      mirror = rng.random(self.size) < 0.5
      crops = offsets[self.rows] if 'crop' in self.reader.augment else None
      flips = mirror[self.rows] if 'flip' in self.reader.augment else None
    return self.reader.batch(indices, crops, flips)


class EvalBatch:
  """(indices, weights) -> an eval batch."""

  def __init__(self, reader: Reader):
    self.reader = reader

  def __call__(self, item: tuple) -> dict:
    indices, weights = item
    return {**self.reader.normalize(self.reader.batch(indices)), 'weights': weights}


def in_workers(items: Any, fn: Callable, workers: int) -> Iterator[dict]:
  """fn over `items` (a grain MapDataset) in `workers` grain processes, in order."""
  import grain  # pylint: disable=import-outside-toplevel
  from absl import flags  # pylint: disable=import-outside-toplevel
  if not flags.FLAGS.is_parsed():  # grain's workers read absl flags (not parsed under pytest).
    flags.FLAGS.mark_as_parsed()
  dataset = items.map(fn).to_iter_dataset()
  if workers:
    dataset = dataset.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers,
                                                               per_worker_buffer_size=2),
                                  worker_init_fn=_init_worker)
  return iter(dataset)


def _init_worker(worker_index: int, worker_count: int) -> None:
  """A grain worker leaves SIGINT and SIGTERM to the training process, which saves and then
  stops its workers: a signal to the whole process group (Ctrl-C, a scheduler's SIGTERM)
  would otherwise kill them under a loop that waits for their next batch.

  It also shortens Python's GIL switch interval: another thread of the worker polls while
  the batch is built, and each time Pillow takes the GIL back after decoding it waited up
  to the default 5 ms; a batch of 128 8x8 PNGs took ~190 ms instead of ~20 (measured), ~40
  with 0.1 ms.
  """
  del worker_index, worker_count
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  sys.setswitchinterval(1e-4)


class Counted:
  """Batches from the workers, normalised here, their rows added to this process's count."""

  def __init__(self, batches: Iterator[dict], reader: Reader):
    self.batches, self.reader = batches, reader

  def __iter__(self) -> 'Counted':
    return self

  def __next__(self) -> dict:
    batch = next(self.batches)
    self.reader.records_read += len(batch['targets'])
    return self.reader.normalize(batch)

  def close(self) -> None:
    self.batches.close()


def load(data_config: ml_collections.ConfigDict, seed: int) -> Dataset:
  import grain  # pylint: disable=import-outside-toplevel
  path = data_config.path
  meta = read_metadata(path)
  augment = tuple(a for a in data_config.get('augment', '').split(',') if a)
  workers = data_config.get('workers', 0)
  train = Reader(path, meta, 'train', augment)
  val = Reader(path, meta, 'val')

  def train_batch(step, global_batch_size, rows):
    return train.normalize(TrainBatch(train, seed, global_batch_size, rows)(step))

  def train_iterator(start, global_batch_size, rows):
    steps = grain.MapDataset.range(start, 2**62)
    return Counted(in_workers(steps, TrainBatch(train, seed, global_batch_size, rows), workers),
                   train)

  def eval_batches(global_batch_size, rows):  # Decoded here: worker start-up would dominate.
    return map(EvalBatch(val), padded_rows(val.size, global_batch_size, rows))

  return Dataset(task='classification', model_fields={'num_classes': len(meta['classes'])},
                 train_batch=train_batch, eval_batches=eval_batches, num_train=train.size,
                 train_iterator=train_iterator if workers else None,
                 examples_read=lambda: train.records_read)


def check_config(data_config: ml_collections.ConfigDict) -> None:
  if not data_config.get('path'):
    fail('data.path', 'is empty; give the directory that `python -m zoo.prepare images` wrote')
  augment = [a for a in data_config.get('augment', '').split(',') if a]
  unknown = [a for a in augment if a not in AUGMENTATIONS]
  if unknown:
    fail('data.augment', f'unknown augmentation {", ".join(map(repr, unknown))}; known: '
         f'{", ".join(AUGMENTATIONS)} (comma-separated, e.g. crop,flip; empty: none)')
  if not 0 <= data_config.get('workers', 0) <= MAX_WORKERS:
    fail('data.workers', f'must be >= 0 and at most {MAX_WORKERS} (0: decode in the loop\'s '
         f'prefetch thread; a few per core at most), got {data_config.workers}')
  read_metadata(data_config.path)


SOURCE = DataSource(load, task='classification', check_config=check_config)
