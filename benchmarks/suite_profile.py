r"""Where the test suite's time goes: per test file, wall and CPU time (the tests' own and
their subprocesses'), Python processes started, and JAX's tracing, lowering and XLA
compilation, with the compilation cache's hits and misses. Not a test.

    python benchmarks/suite_profile.py [--out=suite_profile.json] [-- PYTEST ARGS]

Runs the README's test command (`python -m pytest -q -n 2 tests`, or the arguments after
`--`) with two probes: a pytest plugin that times each test (wall, and CPU of the test's
process plus every child it waited for, from getrusage) and a `sitecustomize` that every
Python process of the run loads (PYTHONPATH), which counts the process and records JAX's
compile events, each under the test that was running (PYTEST_CURRENT_TEST, which the
processes a test starts inherit). `compile` is XLA's backend compile of the programs the
cache missed; `cache` the time spent loading the hits. The probes cost ~1 s per process.
"""
import argparse
import collections
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tables import print_rows  # pylint: disable=wrong-import-position

# Loaded by every Python process of the run: one JSON line per process and per JAX event.
SITECUSTOMIZE = r'''
import importlib.abc, importlib.util, json, os, sys, time
_OUT = os.path.join(os.environ['ZOO_SUITE_PROFILE'], f'{os.getpid()}.jsonl')
def _write(**row):
  row['test'] = os.environ.get('PYTEST_CURRENT_TEST', '').split(' ')[0]
  with open(_OUT, 'a', encoding='utf-8') as f:
    f.write(json.dumps(row) + '\n')
_write(kind='process', argv=sys.argv[:2])
_EVENTS = {'/jax/core/compile/jaxpr_trace_duration': 'trace',
           '/jax/core/compile/jaxpr_to_mlir_module_duration': 'lower',
           '/jax/core/compile/backend_compile_duration': 'backend',
           '/jax/compilation_cache/cache_retrieval_time_sec': 'cache'}
def _listen():
  import jax.monitoring as m
  m.register_event_duration_secs_listener(
      lambda event, secs, **kw: event in _EVENTS and _write(kind=_EVENTS[event], secs=secs,
                                                             program=kw.get('fun_name', '')))
  m.register_event_listener(lambda event, **kw: event.endswith(('/cache_hits', '/cache_misses'))
                            and _write(kind=event.rsplit('/', 1)[1]))
class _AfterJax(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path, target=None):
    if name != 'jax':
      return None
    sys.meta_path.remove(self)
    spec = importlib.util.find_spec('jax')
    run = spec.loader.exec_module
    def exec_module(module):
      run(module)
      _listen()
    spec.loader.exec_module = exec_module
    return spec
sys.meta_path.insert(0, _AfterJax())
'''

# The pytest plugin: wall and CPU (own and waited-for children's) per test.
PLUGIN = r'''
import json, os, resource, time
import pytest
def _cpu(who):
  r = resource.getrusage(who)
  return r.ru_utime + r.ru_stime
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  t0, s0, c0 = time.monotonic(), _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
  yield
  row = dict(kind='test', test=item.nodeid, wall=time.monotonic() - t0,
             cpu=_cpu(resource.RUSAGE_SELF) - s0, children=_cpu(resource.RUSAGE_CHILDREN) - c0)
  with open(os.path.join(os.environ['ZOO_SUITE_PROFILE'], f'tests-{os.getpid()}.jsonl'), 'a') as f:
    f.write(json.dumps(row) + '\n')
'''


def summarise(rows: list[dict]) -> list[dict]:
  """One row per test file, the slowest first, and a total."""
  files = collections.defaultdict(collections.Counter)
  for r in rows:
    name = r['test'].split('::')[0].replace('tests/', '') or '(outside a test)'
    f = files[name]
    if r['kind'] == 'test':
      f['tests'] += 1
      for k in ('wall', 'cpu', 'children'):
        f[k] += r[k]
    elif r['kind'] == 'process':
      f['processes'] += 1
    elif r['kind'] in ('cache_hits', 'cache_misses'):
      f[r['kind'][6:]] += 1
    else:
      f[r['kind']] += r['secs']
  out = []
  for name, f in sorted(files.items(), key=lambda kv: -kv[1]['wall']):
    out.append({'file': name, 'tests': f['tests'], 'wall_s': f['wall'], 'cpu_s': f['cpu'],
                'children_cpu_s': f['children'], 'processes': f['processes'],
                'trace_s': f['trace'], 'lower_s': f['lower'],
                'compile_s': f['backend'] - f['cache'], 'cache_s': f['cache'],
                'hits': f['hits'], 'misses': f['misses']})
  total = {k: sum(r[k] for r in out) for k in out[0] if k != 'file'}
  return out + [{'file': 'total', **total}]


def by_program(rows: list[dict], top: int = 25) -> list[dict]:
  """The programs that took the most tracing, lowering and compiling, summed over the run
  (jit(f) is f's name: every shape and config of it together)."""
  programs = collections.defaultdict(lambda: collections.defaultdict(float))
  for r in rows:
    if r['kind'] in ('trace', 'lower', 'backend', 'cache') and r.get('program'):
      name = r['program']  # Traced as f, lowered and compiled as jit(f).
      p = programs[name[4:-1] if name.startswith('jit(') else name]
      p[r['kind']] += r['secs']
      p['n_' + r['kind']] += 1
  out = [{'program': name, 'traces': int(p['n_trace']), 'trace_s': p['trace'],
          'lower_s': p['lower'], 'compiles': int(p['n_backend']),
          'compile_s': p['backend'] - p['cache']} for name, p in programs.items()]
  out.sort(key=lambda r: -(r['trace_s'] + r['lower_s'] + r['compile_s']))
  return out[:top]


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--out', default='suite_profile.json')
  args, pytest_args = parser.parse_known_args()
  pytest_args = [a for a in pytest_args if a != '--'] or ['-q', '-n', '2', 'tests']
  probes = tempfile.mkdtemp(prefix='zoo-suite-probes-')
  records = tempfile.mkdtemp(prefix='zoo-suite-records-')
  with open(os.path.join(probes, 'sitecustomize.py'), 'w', encoding='utf-8') as f:
    f.write(SITECUSTOMIZE)
  with open(os.path.join(probes, 'zoo_suite_plugin.py'), 'w', encoding='utf-8') as f:
    f.write(PLUGIN)
  env = {**os.environ, 'ZOO_SUITE_PROFILE': records,
         'PYTHONPATH': os.pathsep.join(p for p in (probes, os.environ.get('PYTHONPATH')) if p)}
  t0 = time.monotonic()
  done = subprocess.run([sys.executable, '-m', 'pytest', '-p', 'zoo_suite_plugin', *pytest_args],
                        cwd=ROOT, env=env, check=False)
  wall = time.monotonic() - t0
  rows = []
  for path in glob.glob(os.path.join(records, '*.jsonl')):
    with open(path, encoding='utf-8') as f:
      rows += [json.loads(line) for line in f if line.strip()]
  table = summarise(rows)
  print_rows(f'pytest {" ".join(pytest_args)}: {wall:.0f} s wall, exit {done.returncode}', table)
  programs = by_program(rows)
  print_rows('the programs that took the most tracing, lowering and compiling', programs)
  with open(args.out, 'w', encoding='utf-8') as f:
    json.dump({'wall_s': wall, 'returncode': done.returncode, 'files': table,
               'programs': programs,
               'tests': [r for r in rows if r['kind'] == 'test']}, f, indent=1)
  print(f'\nwrote {args.out}')


if __name__ == '__main__':
  main()
