"""Conversations made from the docstrings of Python's standard library: a chat dataset that
ships with Python, for experiments/finetune_chat.py (no download at run time).

Each conversation asks what a public function or class of a common module does and
answers with the first paragraph of its docstring; one in four asks about two of the
same module in two turns, one in three opens with a system message. The same Python
version gives the same file.

    python -c "from zoo.data import docstring_chat; docstring_chat.write('data/chat.jsonl')"
"""
import importlib
import inspect
import json
import random
import re

MODULES = ('argparse', 'base64', 'bisect', 'calendar', 'collections', 'colorsys', 'contextlib',
           'copy', 'csv', 'dataclasses', 'datetime', 'decimal', 'difflib', 'enum', 'fnmatch',
           'fractions', 'functools', 'glob', 'gzip', 'hashlib', 'heapq', 'hmac', 'html',
           'inspect', 'itertools', 'json', 'logging', 'math', 'operator', 'os', 'os.path',
           'pathlib', 'pprint', 'queue', 'random', 're', 'secrets', 'shlex', 'shutil',
           'statistics', 'string', 'struct', 'tempfile', 'textwrap', 'threading', 'time',
           'typing', 'unicodedata', 'urllib.parse', 'uuid', 'zipfile', 'zlib')
SYSTEM = "You answer questions about Python's standard library in one paragraph."
QUESTIONS = ('What does `{name}` do?', 'What is `{name}` for?', 'Explain `{name}`.',
             'How would you describe `{name}` in Python?')


def _first_paragraph(doc: str) -> str:
  """The docstring's first paragraph that is prose (not a signature line), on one line."""
  for paragraph in inspect.cleandoc(doc).split('\n\n'):
    text = ' '.join(paragraph.split())
    if text and not re.match(r'^[\w.]+\(.*\)( -> .*)?$', text):
      return text
  return ''


def entries() -> list[tuple[str, str]]:
  """(qualified name, answer) for each documented public function or class, sorted."""
  found = {}
  for module_name in MODULES:
    module = importlib.import_module(module_name)
    for name in sorted(getattr(module, '__all__', None) or dir(module)):
      if name.startswith('_'):
        continue
      obj = getattr(module, name, None)
      if not (inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.isclass(obj)):
        continue
      answer = _first_paragraph(getattr(obj, '__doc__', None) or '')
      if 40 <= len(answer) <= 500 and answer[0].isupper():
        found.setdefault(f'{module_name}.{name}', answer)
  return sorted(found.items())


def conversations(seed: int = 0) -> list[dict]:
  """The conversations, in a fixed order from `seed`."""
  rng = random.Random(seed)
  items = entries()
  rng.shuffle(items)
  out = []
  while items:
    name, answer = items.pop()
    messages = [{'role': 'system', 'content': SYSTEM}] if rng.random() < 1 / 3 else []
    messages += [{'role': 'user', 'content': rng.choice(QUESTIONS).format(name=name)},
                 {'role': 'assistant', 'content': answer}]
    module = name.rsplit('.', 1)[0]
    other = next((i for i, (n, _) in enumerate(items) if n.rsplit('.', 1)[0] == module), None)
    if other is not None and rng.random() < 0.25:
      name2, answer2 = items.pop(other)
      messages += [{'role': 'user', 'content': f'And `{name2}`?'},
                   {'role': 'assistant', 'content': answer2}]
    out.append({'messages': messages})
  return out


def write(path: str, seed: int = 0) -> int:
  """Writes the conversations as JSON Lines to `path`; returns how many."""
  items = conversations(seed)
  with open(path, 'w', encoding='utf-8') as f:
    f.writelines(json.dumps(c) + '\n' for c in items)
  return len(items)
