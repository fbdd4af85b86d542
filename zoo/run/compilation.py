"""XLA's persistent compilation cache, and a count of what this process compiled.

With a cache directory, each compiled program (train step, eval step, initialisation)
is stored under a key of its HLO, devices and flags; a restarted run with the same
config and mesh loads its programs instead of compiling them.
"""
import collections
import os

import jax

_COUNTS = collections.Counter()


def _count(event, **_):
  if event in ('/jax/compilation_cache/cache_hits', '/jax/compilation_cache/cache_misses'):
    _COUNTS[event.rsplit('_', 1)[-1]] += 1  # 'hits' or 'misses'.


jax.monitoring.register_event_listener(_count)


def enable_cache(directory: str) -> None:
  """Caches every compiled program in `directory` (call before anything compiles)."""
  # A gs:// URL is JAX's to read and write (through etils.epath, as the workdir's files).
  jax.config.update('jax_compilation_cache_dir',
                    directory if '://' in directory else os.path.abspath(directory))
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)  # Small steps too.
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)


def summary() -> str:
  """'N programs loaded from the cache, M compiled', or '' if no cache was used."""
  if not _COUNTS:
    return ''
  return f'{_COUNTS["hits"]} programs loaded from the cache, {_COUNTS["misses"]} compiled'
