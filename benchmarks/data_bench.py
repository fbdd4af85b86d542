r"""Data benchmark: memory, per-process reads, input stalls and prepare speed. Not a test.

    python benchmarks/data_bench.py [--out=data_bench.json] [--big_gb=4] [--skip=...]

Prints one table per part and writes them all as JSON:
  memory     peak RSS of the same short char_lm:smoke run (one CPU device) on a generated
             token dataset of ~40 MB and of --big_gb GB (goal: within 300 MB of each other)
  reads      a 2-process run (launch/local.py, 4 CPU devices each) on a token dataset: the
             training examples each process read (its log line) against the global batch
             size, and the largest relative loss difference to the same run in 1 process
  stalls     perf/data_wait_s over perf/step_time_s, from metrics.jsonl, one CPU device:
             every experiment (its full config, 100-400 steps; bpe_lm needs --stdlib_bpe,
             its mixture --topics_bpe too), and the digits CNN (pixels, and PNG files with 0
             and 2 workers), ResNet and ViT on records with crop+flip (goal <= 2%)
  packing    host tokens/s of building train batches from --stdlib_bpe: packed documents
             and a two-source mixture against the plain stream windows
  images     decode+augment throughput of the record pipeline alone, images/s per host,
             0 and 2 workers: the 8x8 digits, and generated 128x128 JPEGs
  prepare    tokens/s of zoo.tokens.prepare on the standard library's source with the
             stdlib BPE's tokenizer.json, against the tokenizer's own batch encoder over
             the same documents in memory (goal >= 0.8x)
"""
import argparse
import json
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
EXPERIMENTS = os.path.join(ROOT, 'experiments')

from zoo.data import documents, tokens  # pylint: disable=wrong-import-position
from zoo.data import tokenizer as tokenizer_lib  # pylint: disable=wrong-import-position

import tables  # pylint: disable=wrong-import-position  # benchmarks/tables.py


def _env():
  return {k: v for k, v in os.environ.items() if k not in ('XLA_FLAGS', 'JAX_COMPILATION_CACHE_DIR')}


def _zoo(args, workdir):
  """Runs `python -m zoo.main` to completion; returns (stderr, peak RSS of the child in MB)."""
  proc = subprocess.Popen([sys.executable, '-m', 'zoo.main', f'--workdir={workdir}', *args],
                          cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
  stderr = proc.stderr.read()  # Until the child exits; then its own resource usage.
  _, status, usage = os.wait4(proc.pid, 0)
  proc.returncode = os.waitstatus_to_exitcode(status)
  if proc.returncode:
    raise RuntimeError(f'zoo.main failed:\n{stderr[-3000:]}')
  return stderr, usage


def generate_tokens(directory, gigabytes, seed=0):
  """A token dataset of random byte tokens (the bytes tokenizer), written shard by shard, in
  documents of 64 to 2,047 tokens each ended by the end-of-document token (the document
  index that packed windows read)."""
  os.makedirs(directory, exist_ok=True)
  tokenizer = tokenizer_lib.bytes_tokenizer()
  total = int(gigabytes * 2**30) // 2
  writers = {s: tokens.ShardWriter(directory, s, np.dtype('<u2'), 2**28) for s in tokens.SPLITS}
  rng = np.random.default_rng(seed)
  sizes = {'train': total - total // 100, 'val': total // 100}
  documents = {}
  for split, size in sizes.items():
    lengths = rng.integers(64, 2048, size=size // 64 + 1)
    ends = np.cumsum(lengths)
    ends = np.append(ends[ends < size], size)
    documents[split] = len(ends)
    np.save(os.path.join(directory, f'{split}-documents.npy'), ends.astype(np.int64))
    for start in range(0, size, 2**26):
      chunk = rng.integers(0, 256, size=min(2**26, size - start), dtype=np.uint16)
      last = ends[(ends > start) & (ends <= start + len(chunk))] - 1 - start
      chunk[last] = 256  # Each document's last token.
      writers[split].write(chunk)
  tokenizer.save(os.path.join(directory, 'tokenizer.json'))
  np.save(os.path.join(directory, 'token_bytes.npy'), tokenizer_lib.token_bytes(tokenizer))
  meta = {'format': tokens.FORMAT, 'version': tokens.VERSION, 'vocab_size': 257, 'dtype': '<u2',
          'eos_id': 256, 'tokenizer': {'file': 'tokenizer.json'}, 'token_bytes': 'token_bytes.npy',
          'splits': {s: {'tokens': sizes[s], 'documents': documents[s], 'bytes': sizes[s],
                         'shards': writers[s].close(), 'documents_file': f'{s}-documents.npy'}
                     for s in tokens.SPLITS}}
  with open(os.path.join(directory, tokens.METADATA), 'w', encoding='utf-8') as f:
    json.dump(meta, f)


def memory(root, big_gb):
  rows = []
  for label, gb in (('40 MB', 0.04), (f'{big_gb:g} GB', big_gb)):
    path = os.path.join(root, f'tokens_{gb}')
    t0 = time.perf_counter()
    generate_tokens(path, gb)
    generate_s = time.perf_counter() - t0
    args = [f'--config={EXPERIMENTS}/char_lm.py:smoke', '--cpu_devices=1',
            '--config.mesh.shape=(1,1)', '--config.data.name=tokens', f'--config.data.path={path}',
            '--config.train.steps=300', '--config.eval.every_steps=300',
            '--config.checkpoint.every_steps=300']
    _, usage = _zoo(args, os.path.join(root, f'run_{gb}'))
    rows.append({'dataset': label, 'bytes': sum(os.path.getsize(os.path.join(path, f))
                                                for f in os.listdir(path)),
                 'generate_s': generate_s, 'peak_rss_mb': usage.ru_maxrss / 1024})
  rows[1]['rss_over_small_mb'] = rows[1]['peak_rss_mb'] - rows[0]['peak_rss_mb']
  return rows


def reads(root):
  path = os.path.join(root, 'tokens_0.04')
  if not os.path.isdir(path):
    generate_tokens(path, 0.04)
  flags = [f'--config={EXPERIMENTS}/char_lm.py:smoke', '--config.data.name=tokens',
           f'--config.data.path={path}', '--config.train.steps=20', '--config.train.log_every_steps=1',
           '--config.mesh.shape=(4,2)', '--config.eval.every_steps=20']
  workdir = os.path.join(root, 'reads_two')
  out = subprocess.run([sys.executable, os.path.join(ROOT, 'launch', 'local.py'), '--processes=2',
                        '--devices=4', '--', *flags, f'--workdir={workdir}'], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, check=True).stdout
  one = os.path.join(root, 'reads_one')
  _zoo([*flags, '--cpu_devices=8'], one)
  losses = [[json.loads(l)['train/loss'] for l in open(os.path.join(d, 'metrics.jsonl'))
             if 'train/loss' in l] for d in (workdir, one)]
  diff = max(abs(a - b) / abs(b) for a, b in zip(*losses))
  rows = []
  for i in (0, 1):
    m = re.search(rf'\[process {i}\] .*read (\d+) training examples for (\d+) steps', out)
    rows.append({'process': i, 'examples_read': int(m.group(1)), 'steps': int(m.group(2)),
                 'global_batch': 16, 'per_step': int(m.group(1)) / int(m.group(2)),
                 'max_rel_loss_diff_vs_1_process': diff})
  return rows


def _wait_fraction(workdir):
  rows = [json.loads(l) for l in open(os.path.join(workdir, 'metrics.jsonl'))
          if 'perf/data_wait_s' in l][1:]  # The first interval includes warm-up.
  wait = sum(r['perf/data_wait_s'] for r in rows) / len(rows)
  step = sum(r['perf/step_time_s'] for r in rows) / len(rows)
  return wait, step


def digits_records(root, store='auto'):
  """The digits as 8x8 PNGs, prepared as records: pixels (--store=auto) or the PNG files."""
  path = os.path.join(root, f'digits_records_{store}')
  if not os.path.isdir(os.path.join(root, 'digits_png')):
    from zoo.data import digits  # pylint: disable=import-outside-toplevel
    digits.write_image_folder(os.path.join(root, 'digits_png'))
  if not os.path.isdir(path):
    subprocess.run([sys.executable, '-m', 'zoo.prepare', 'images', f'--input={root}/digits_png',
                    f'--output={path}', f'--store={store}'], cwd=ROOT, check=True,
                   capture_output=True)
  return path


def stalls(root, stdlib_bpe, topics_bpe, only=''):
  """Every experiment's data wait (its full config, fewer steps but for the digits MLP and
  CNN, whose millisecond steps show a busy host's bursts), and the image models on records
  with crop+flip, pixels and PNG files. `only`: runs whose label starts with one of these
  (comma-separated)."""
  runs = [(name, [f'--config={EXPERIMENTS}/{name}.py', f'--config.train.steps={steps}'])
          for name, steps in (('mlp_digits', 1000), ('cnn_digits', 1000), ('resnet_digits', 200),
                              ('vit_digits', 200), ('char_lm', 100), ('seq_sort', 200))]
  if stdlib_bpe:
    runs.append(('bpe_lm (packed documents)', [f'--config={EXPERIMENTS}/bpe_lm.py',
                                               f'--config.data.path={stdlib_bpe}',
                                               '--config.train.steps=100']))
  if stdlib_bpe and topics_bpe:
    runs.append(('bpe_lm:mixture (code 0.8, docs 0.2)', [
        f'--config={EXPERIMENTS}/bpe_lm.py:mixture', f'--config.data.sources.code={stdlib_bpe}',
        f'--config.data.sources.docs={topics_bpe}', '--config.train.steps=100']))
  for name, store, workers, steps in (('cnn_digits', 'auto', 0, 400), ('cnn_digits', 'file', 0, 400),
                                      ('cnn_digits', 'file', 2, 400), ('resnet_digits', 'auto', 0, 200),
                                      ('vit_digits', 'auto', 0, 200)):
    runs.append((f'{name} on records ({"pixels" if store == "auto" else "PNG files"}), crop+flip, '
                 f'{workers} workers',
                 [f'--config={EXPERIMENTS}/{name}.py', '--config.data.name=records',
                  f'--config.data.path={digits_records(root, store)}',
                  '--config.data.augment=crop,flip', f'--config.data.workers={workers}',
                  f'--config.train.steps={steps}']))
  rows = []
  for label, args in runs:
    if only and not any(label.startswith(o) for o in only.split(',')):
      continue
    workdir = os.path.join(root, f'stall_{len(rows)}')
    _zoo([*args, '--cpu_devices=1', '--config.mesh.shape=(1,1)', '--config.train.log_every_steps=20',
          '--config.eval.every_steps=100000', '--config.checkpoint.every_steps=100000'], workdir)
    wait, step = _wait_fraction(workdir)
    rows.append({'run': label, 'data_wait_s': wait, 'step_time_s': step, 'wait_fraction': wait / step})
  return rows


def packing(stdlib_bpe, topics_bpe, steps=200, batch=32, seq_len=128):
  """Host tokens/s of building this process's train batches (read, pack, mix), one thread:
  packed documents and a two-source mixture against the plain stream windows."""
  import ml_collections  # pylint: disable=import-outside-toplevel
  from zoo import data  # pylint: disable=import-outside-toplevel
  configs = [('stream windows (data.windows=stream)', {'path': stdlib_bpe, 'windows': 'stream'}),
             ('packed documents (the default)', {'path': stdlib_bpe, 'windows': 'documents'})]
  if topics_bpe:
    configs.append(('packed, mixture code 0.8 / docs 0.2', {
        'path': '', 'windows': 'documents', 'sources': {'code': stdlib_bpe, 'docs': topics_bpe},
        'weights': {'code': 0.8, 'docs': 0.2}}))
  rows, base = [], None
  for label, fields in configs:
    config = ml_collections.ConfigDict({'name': 'tokens', 'seq_len': seq_len, **fields})
    t0 = time.perf_counter()
    dataset = data.load(config, 0)
    load_s = time.perf_counter() - t0
    dataset.train_batch(0, batch, slice(None))
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
      dataset.train_batch(step, batch, slice(None))
    rate = steps * batch * seq_len / (time.perf_counter() - t0)
    base = base or rate
    rows.append({'reader': label, 'tokens_per_s': rate, 'vs_stream': rate / base,
                 'load_s': load_s})
  return rows


def _jpeg_folder(root, count=512, size=128):
  from PIL import Image  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  for split, n in (('train', count), ('val', 16)):
    for i in range(n):
      folder = os.path.join(root, split, str(i % 4))
      os.makedirs(folder, exist_ok=True)
      pixels = (rng.random((size // 8, size // 8, 3)) * 255).astype(np.uint8)
      Image.fromarray(pixels).resize((size, size)).save(os.path.join(folder, f'{i}.jpg'), quality=90)


def images(root):
  import ml_collections  # pylint: disable=import-outside-toplevel
  from zoo.data import records  # pylint: disable=import-outside-toplevel
  jpeg_root, jpeg_path = os.path.join(root, 'jpeg_png'), os.path.join(root, 'jpeg_records')
  if not os.path.isdir(jpeg_path):
    _jpeg_folder(jpeg_root)
    subprocess.run([sys.executable, '-m', 'zoo.prepare', 'images', f'--input={jpeg_root}',
                    f'--output={jpeg_path}'], cwd=ROOT, check=True, capture_output=True)
  rows = []
  for label, path, batch, steps in (('digits 8x8 pixels', digits_records(root), 128, 100),
                                    ('digits 8x8 PNG', digits_records(root, 'file'), 128, 100),
                                    ('128x128 JPEG', jpeg_path, 64, 40)):
    for workers in (0, 2):
      config = ml_collections.ConfigDict({'name': 'records', 'path': path, 'augment': 'crop,flip',
                                          'workers': workers})
      dataset = records.load(config, 0)
      if workers:
        batches = dataset.train_iterator(0, batch, slice(None))
        next(batches)  # Workers started.
        t0 = time.perf_counter()
        for _ in range(steps):
          next(batches)
        seconds = time.perf_counter() - t0
        batches.close()
      else:
        dataset.train_batch(0, batch, slice(None))
        t0 = time.perf_counter()
        for step in range(1, steps + 1):
          dataset.train_batch(step, batch, slice(None))
        seconds = time.perf_counter() - t0
      rows.append({'images': label, 'workers': workers, 'batch': batch,
                   'images_per_s': steps * batch / seconds})
  return rows


def prepare(root, stdlib_bpe):
  stdlib = sysconfig.get_paths()['stdlib']
  files = documents.expand([f'{stdlib}/**/*.py'], ['*/site-packages/*'])
  files = [f for f in files if f not in set(documents.undecodable(files))]
  tokenizer = tokenizer_lib.load(os.path.join(stdlib_bpe, 'tokenizer.json'))
  texts = [t for f in files for t in documents.read(f)]
  chunks, chunk, size = [], [], 0
  for t in texts:  # The same ~4 MB chunks as zoo's prepare.
    chunk.append(t)
    size += len(t.encode('utf-8'))
    if size >= 2**22:
      chunks.append(chunk)
      chunk, size = [], 0
  chunks.append(chunk)
  t0 = time.perf_counter()
  count = sum(len(e.ids) for c in chunks for e in tokenizer.encode_batch_fast(c, add_special_tokens=False))
  encoder_s = time.perf_counter() - t0
  out = os.path.join(root, 'prepared')
  os.makedirs(out)
  t0 = time.perf_counter()
  meta = tokens.prepare(files, out, tokenizer, val_fraction=0.02)
  prepare_s = time.perf_counter() - t0
  written = sum(meta['splits'][s]['tokens'] for s in tokens.SPLITS)
  return [{'corpus': f'stdlib .py, {len(files)} files, {sum(len(t.encode()) for t in texts) / 1e6:.1f} MB',
           'encoder_tokens_per_s': count / encoder_s, 'prepare_tokens_per_s': written / prepare_s,
           'ratio': (written / prepare_s) / (count / encoder_s), 'encoder_s': encoder_s,
           'prepare_s': prepare_s}]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--out', default='data_bench.json')
  parser.add_argument('--big_gb', type=float, default=4.0)
  parser.add_argument('--stdlib_bpe', default='data/stdlib_bpe',
                      help="the BPE LM's dataset (see experiments/bpe_lm.py); '' skips its parts")
  parser.add_argument('--topics_bpe', default='data/topics_bpe',
                      help="the Python docs in the stdlib BPE (experiments/bpe_lm.py:mixture)")
  parser.add_argument('--stalls_only', default='',
                      help='stalls: only the runs whose label starts with one of these')
  parser.add_argument('--skip', default='',
                      help='comma-separated: memory,reads,stalls,packing,images,prepare')
  parser.add_argument('--root', default='', help='scratch directory (default: a temporary one)')
  args = parser.parse_args()
  skip = set(filter(None, args.skip.split(',')))
  stdlib_bpe = args.stdlib_bpe if args.stdlib_bpe and os.path.isdir(args.stdlib_bpe) else ''
  topics_bpe = args.topics_bpe if args.topics_bpe and os.path.isdir(args.topics_bpe) else ''
  results = {'machine': {'cpus': os.cpu_count()}}
  with tempfile.TemporaryDirectory(dir=args.root or None) as root:
    for name, fn in (('memory', lambda: memory(root, args.big_gb)), ('reads', lambda: reads(root)),
                     ('stalls', lambda: stalls(root, stdlib_bpe, topics_bpe, args.stalls_only)),
                     ('packing', lambda: packing(stdlib_bpe, topics_bpe) if stdlib_bpe else None),
                     ('images', lambda: images(root)),
                     ('prepare', lambda: prepare(root, stdlib_bpe) if stdlib_bpe else None)):
      if name in skip:
        continue
      rows = fn()
      if rows:
        results[name] = rows
        tables.print_rows(name, rows)
        with open(args.out, 'w', encoding='utf-8') as f:
          json.dump(results, f, indent=2)
  print(f'\nwrote {args.out}')


if __name__ == '__main__':
  main()
