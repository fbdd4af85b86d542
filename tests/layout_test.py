"""zoo/'s parts import downward only, and no module imports itself through others (type-only
imports count: they are circles too, only hidden)."""
import ast
import os

from conftest import REPO

# Top to bottom: a part may import the parts below it, never one above.
PARTS = ('commands', 'shell', 'hf', 'run', 'data', 'store', 'models', 'parallel', 'errors')
COMMANDS = ('main', 'prepare', 'sample', 'convert', 'evaluate')


def _modules() -> dict[str, str]:
  """Dotted module name -> file, for every module under zoo/."""
  found = {}
  for folder, _, files in os.walk(os.path.join(REPO, 'zoo')):
    for name in files:
      if name.endswith('.py'):
        path = os.path.join(folder, name)
        dotted = os.path.relpath(path, REPO)[:-3].replace(os.sep, '.')
        found[dotted.removesuffix('.__init__')] = path
  return found


def _imports(path: str, modules: dict) -> set[str]:
  """The zoo modules a file imports (`from zoo.x import y` names y if y is a module)."""
  with open(path, encoding='utf-8') as f:
    tree = ast.parse(f.read())
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith('zoo'):
      for alias in node.names:
        child = f'{node.module}.{alias.name}'
        out.add(child if child in modules else node.module)
    elif isinstance(node, ast.Import):
      out.update(a.name for a in node.names if a.name.startswith('zoo'))
  return out


def _part(module: str) -> str:
  name = module.split('.')[1] if '.' in module else ''
  return 'commands' if name in COMMANDS else name


def _graph():
  modules = _modules()
  return {m: _imports(path, modules) - {m, 'zoo'} for m, path in modules.items()}


def test_every_module_belongs_to_a_part():
  strays = [m for m in _graph() if m != 'zoo' and _part(m) not in PARTS]
  assert not strays, f'modules outside the parts {PARTS}: {strays}'


def test_parts_import_downward_only():
  upward = [f'{m} -> {d}' for m, deps in _graph().items() for d in deps
            if m != 'zoo' and PARTS.index(_part(d)) < PARTS.index(_part(m))]
  assert not upward, upward


def test_no_module_imports_itself_through_others():
  graph, state, circles = _graph(), {}, []
  def visit(module, path):
    state[module] = 'open'
    for dep in sorted(graph.get(module, ())):
      if state.get(dep) == 'open':
        circles.append(' -> '.join(path[path.index(dep):] + [dep]))
      elif dep not in state:
        visit(dep, path + [dep])
    state[module] = 'done'
  for module in sorted(graph):
    if module not in state:
      visit(module, [module])
  assert not circles, circles
