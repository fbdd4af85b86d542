r"""Loss parity of low-precision training: an experiment trained from scratch in bf16, in int8
and in fp8 (model.quantization), each run exactly as a user runs it. Not a test.

    python benchmarks/quant_bench.py [--experiments=char_lm,bpe_lm] [--out=quant_bench.json]
    python benchmarks/quant_bench.py --smoke       # char_lm:smoke, seconds: the plumbing

Each row is `python -m zoo.main --config=experiments/<name>.py --workdir=TMP
--config.model.dtype=bfloat16 --config.model.quantization=<kind>` (the experiment's steps,
data and evals; bf16 compute in all three, so the rows differ by the quantized matmuls
alone), on this machine's default devices. The held-out figure is the experiment's
documented one at its last eval (char_lm: eval/bits_per_char; bpe_lm: eval/bits_per_byte);
issue 57's target: int8 and fp8 within 2% of bf16's. bpe_lm's token dataset is made with
zoo.prepare as its docstring says (or reused from --data_dir). Prints a table (the figure,
its ratio to bf16, wall time, median step time) and writes JSON. On a CPU both low-precision
types are emulated: the time column says nothing of an accelerator's speed.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = ('none', 'int8', 'fp8')
FIGURES = {'char_lm': 'eval/bits_per_char', 'bpe_lm': 'eval/bits_per_byte'}


def _env():
  path = os.environ.get('PYTHONPATH')
  return {**os.environ, 'PYTHONPATH': ROOT + (os.pathsep + path if path else '')}


def prepare_bpe(data_dir: str) -> None:
  """bpe_lm's dataset, as experiments/bpe_lm.py's docstring makes it (unless present)."""
  if os.path.exists(os.path.join(data_dir, 'metadata.json')):
    return
  stdlib = sysconfig.get_paths()['stdlib']
  subprocess.run([sys.executable, '-m', 'zoo.prepare', 'text', f'--input={stdlib}/**/*.py',
                  '--exclude=*/site-packages/*', '--skip_undecodable', f'--output={data_dir}',
                  '--tokenizer=bpe', '--vocab_size=8192', '--val_fraction=0.02'],
                 cwd=ROOT, env=_env(), check=True, capture_output=True)


def run(name: str, kind: str, scratch: str, flags: list) -> dict:
  """One run of experiment `name` ('char_lm', or with its variant: 'char_lm:smoke')."""
  experiment, _, variant = name.partition(':')
  workdir = os.path.join(scratch, f'{experiment}_{kind}')
  argv = [sys.executable, '-m', 'zoo.main',
          f'--config=experiments/{experiment}.py' + (f':{variant}' if variant else ''),
          f'--workdir={workdir}', '--config.model.dtype=bfloat16',
          f'--config.model.quantization={kind}', *flags]
  t0 = time.perf_counter()
  done = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True, check=False)
  row = {'experiment': name, 'quantization': kind,
         'command': ' '.join(['python -m zoo.main'] + argv[3:]),
         'wall_s': round(time.perf_counter() - t0, 1)}
  if done.returncode:
    return {**row, 'error': done.stderr.strip().splitlines()[-1][:300]}
  with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
    rows = [json.loads(line) for line in f]
  figure = FIGURES[experiment]
  evals = [r for r in rows if figure in r]
  times = [r['perf/step_time_s'] for r in rows if 'perf/step_time_s' in r][1:]
  shutil.rmtree(workdir, ignore_errors=True)
  return {**row, 'figure': figure, 'value': evals[-1][figure], 'step': evals[-1]['step'],
          'step_time_s': round(statistics.median(times), 4) if times else None}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--experiments', default='char_lm,bpe_lm')
  parser.add_argument('--out', default='quant_bench.json')
  parser.add_argument('--data_dir', default='', help="bpe_lm's token dataset: reused if "
                      'prepared, else made there (default: a temporary directory)')
  parser.add_argument('--smoke', action='store_true', help='char_lm:smoke only (seconds)')
  args = parser.parse_args()
  names = ['char_lm:smoke'] if args.smoke else args.experiments.split(',')
  results = []
  with tempfile.TemporaryDirectory(prefix='quant_bench_') as scratch:
    data_dir = os.path.abspath(args.data_dir or os.path.join(scratch, 'stdlib_bpe'))
    for name in names:
      flags = []
      if name.startswith('bpe_lm'):
        prepare_bpe(data_dir)
        flags.append(f'--config.data.path={data_dir}')
      rows = []
      for kind in KINDS:
        row = run(name, kind, scratch, flags)
        rows.append(row)
        print(json.dumps(row), flush=True)
      base = rows[0].get('value')
      for row in rows:
        if base and row.get('value') is not None:
          row['x_bf16'] = round(row['value'] / base, 4)
          row['within_2%'] = abs(row['x_bf16'] - 1) <= 0.02
      results += rows
      with open(args.out, 'w', encoding='utf-8') as f:
        json.dump({'rows': results}, f, indent=2)
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import tables  # pylint: disable=import-outside-toplevel  # benchmarks/tables.py
  tables.print_rows('held-out figures, bf16 compute, from scratch', [
      {k: r.get(k, '') for k in ('experiment', 'quantization', 'figure', 'value', 'x_bf16',
                                 'within_2%', 'wall_s', 'step_time_s', 'error')}
      for r in results])
  print('wrote', args.out)


if __name__ == '__main__':
  main()
