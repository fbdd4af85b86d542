"""The commands that README.md and docs/ show, run as written: every quick one (`:smoke`,
`--dry_run`; its --workdir moved under a temporary directory) must exit 0, every command
they name must be one of zoo's, and each launcher must answer --help (the zoo.* commands'
--help: shell_test.py), so the docs cannot drift from the code.

Pod plans (`--dry_run --topology`) compile billion-parameter steps for tens of seconds
each: tests/topology_test.py plans small configs on the same targets instead.
"""
import glob
import os
import re
import shlex
import subprocess
import sys

import pytest

from conftest import REPO, cli_env

DOCS = ['README.md'] + sorted(os.path.relpath(p, REPO)
                              for p in glob.glob(os.path.join(REPO, 'docs', '*.md')))
_COMMAND = r'python3? (?:-m zoo\.\w+|launch/\w+\.py)'


def _commands(text):
  """Commands in indented blocks (with their `\\` continuation lines) and in backticks."""
  found, lines = [], text.splitlines()
  for i, line in enumerate(lines):
    if line.startswith('    ') and re.match(_COMMAND, line.strip()) and (
        i == 0 or not lines[i - 1].rstrip().endswith('\\')):
      command, j = line.strip(), i
      while command.endswith('\\') and j + 1 < len(lines):
        j += 1
        command = command[:-1].rstrip() + ' ' + lines[j].strip()
      found.append(command.split(' #')[0].strip())
  found += re.findall(rf'`({_COMMAND}[^`]*)`', text)
  return found


def _all_commands():
  out = {}
  for doc in DOCS:
    with open(os.path.join(REPO, doc), encoding='utf-8') as f:
      for command in _commands(f.read()):
        out.setdefault(command, doc)
  return out


def _quick(command):
  return ((':smoke' in command or '--dry_run' in command) and '--topology' not in command
          and '...' not in command and '--config=' in command)  # Not a bare label.


QUICK = sorted(c for c in _all_commands() if _quick(c))


def test_the_docs_show_quick_commands():
  assert len(QUICK) >= 3, QUICK  # The extraction itself works.


@pytest.mark.parametrize('command', QUICK)
def test_a_quick_command_in_the_docs_runs(command, tmp_path):
  args = shlex.split(command)
  args = [f'--workdir={tmp_path / "run"}' if a.startswith('--workdir=') else a for a in args]
  args[0] = sys.executable
  env = cli_env()
  result = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
  assert result.returncode == 0, (command, _all_commands()[command], result.stderr[-3000:])


def test_every_command_the_docs_name_answers_help():
  programs = sorted({' '.join(shlex.split(c)[1:3] if shlex.split(c)[1] == '-m'
                              else shlex.split(c)[1:2]) for c in _all_commands()})
  assert '-m zoo.main' in programs and '-m zoo.convert' in programs, programs
  assert all(p in ('-m zoo.main', '-m zoo.sample', '-m zoo.convert', '-m zoo.prepare',
                   '-m zoo.evaluate')
             or p.startswith('launch/') for p in programs), programs
  env = cli_env()
  for program in (p for p in programs if p.startswith('launch/')):  # zoo.*: shell_test.py.
    result = subprocess.run([sys.executable, *program.split(), '--help'], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, (program, result.stderr[-2000:])


def _anchor(heading):
  """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped,
  spaces to '-'."""
  return re.sub(r'[^\w\- ]', '', heading.strip().lower()).replace(' ', '-')


def test_every_link_between_the_pages_reaches_a_heading_that_exists():
  """Links from README.md and docs/ to a page of theirs (and its #section) resolve, so
  moving a table between pages cannot leave a link behind."""
  anchors = {}
  for doc in DOCS:
    with open(os.path.join(REPO, doc), encoding='utf-8') as f:
      anchors[doc] = {_anchor(h) for h in re.findall(r'^#+ (.*)$', f.read(), re.M)}
  broken = []
  for doc in DOCS:
    with open(os.path.join(REPO, doc), encoding='utf-8') as f:
      links = re.findall(r'\]\(([^)\s]+)\)', f.read())
    for link in links:
      if re.match(r'[a-z]+://', link):
        continue
      path, _, anchor = link.partition('#')
      target = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
      if not os.path.exists(os.path.join(REPO, target)):
        broken.append(f'{doc}: {link} (no {target})')
      elif anchor and target in anchors and anchor not in anchors[target]:
        broken.append(f'{doc}: {link} (no such heading in {target})')
  assert len(anchors['README.md']) > 5
  assert not broken, broken


def test_the_readme_front_page_stays_short():
  """The front page: two commands, a tour, headline results and links, at most 300 lines;
  detail lives in docs/."""
  with open(os.path.join(REPO, 'README.md'), encoding='utf-8') as f:
    assert len(f.read().splitlines()) <= 300
