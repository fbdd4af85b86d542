"""Text from a trained run: what `zoo.sample` runs (see zoo/sample.py)."""
import math
from typing import Sequence

from absl import logging
import jax
import numpy as np

from zoo.data.dataset import Dataset
from zoo.errors import ConfigError
from zoo.models import decode
from zoo.run import memory
from zoo.run import setup as setup_lib
from zoo.run import workdir as workdir_lib
from zoo.store import checkpoint

MAX_NEW_TOKENS = 2**20  # Per sample and call.
DECODINGS = ('auto', 'cache', 'recompute')


def encode_prompt(dataset: Dataset, prompt: str, vocab_size: int) -> np.ndarray:
  """Token ids [T] of the prompt, by the data's own encoding (characters, or a token
  dataset's tokenizer); for data without one, ids separated by spaces."""
  if dataset.encode is None:
    try:
      ids = np.array([int(t) for t in prompt.split()], dtype=np.int32)
    except ValueError:
      raise ConfigError(f'--prompt: {prompt!r}: this run\'s data are token ids; give ids separated '
                        'by spaces') from None
    if np.any((ids < 0) | (ids >= vocab_size)):
      raise ConfigError(f'--prompt: token ids must be in [0, {vocab_size})')
    return ids
  ids = dataset.encode(prompt)
  if dataset.decode(ids) == prompt:
    return ids
  unknown = sorted({c for c in prompt if dataset.decode(dataset.encode(c)) != c})
  if unknown:
    raise ConfigError(f'--prompt: characters not in the model\'s vocabulary of {vocab_size}: '
                      f'{", ".join(map(repr, unknown))}; leave them out')
  return ids


def generate(workdir: str, prompts: Sequence[str] = ('',), num_tokens: int = 200,
             temperature: float = 0.8, top_k: int = 0, top_p: float = 1.0, num_samples: int = 1,
             seed: int = 0, mesh_shape: str = '', decoding: str = 'auto') -> list[dict]:
  """Samples from the newest checkpoint of `workdir`: `num_samples` per prompt, all in one
  batch. Returns one dict per sample: prompt, text (the continuation), prompt_ids, ids (the
  generated ids), and sample (prompt + continuation, decoded together). Bad input raises
  ZooError before anything compiles."""
  for flag, value in (('num_tokens', num_tokens), ('num_samples', num_samples)):
    if value <= 0:
      raise ConfigError(f'--{flag}: must be positive, got {value}')
  if num_tokens > MAX_NEW_TOKENS:  # A step of the model each: days, at worst.
    raise ConfigError(f'--num_tokens: {num_tokens} is more than one call generates '
                      f'({MAX_NEW_TOKENS:,} per sample); generate in pieces, each prompted with '
                      'the end of the last')
  if not (temperature >= 0 and math.isfinite(temperature)):
    raise ConfigError(f'--temperature: must be a finite number >= 0 (0 is greedy), got '
                      f'{temperature}')
  if not 0 < top_p <= 1:
    raise ConfigError(f'--top_p: must be in (0, 1] (1: all tokens), got {top_p}')
  if decoding not in DECODINGS:
    raise ConfigError(f'--decoding: unknown {decoding!r}; known: {", ".join(DECODINGS)}')
  config, directory = workdir_lib.load_run(workdir)
  dataset = workdir_lib.run_dataset(workdir, config)
  vocab_size = dataset.model_fields['vocab_size']
  if not 0 <= top_k <= vocab_size:
    raise ConfigError(f'--top_k: must be in [0, {vocab_size}] (the vocabulary), got {top_k}')
  encoded = []  # (prompt, ids fed, how many of them are not shown).
  for prompt in prompts:
    ids, hidden = encode_prompt(dataset, prompt, vocab_size), 0
    if not len(ids):  # Nothing to continue: start from a newline (or token 0), not shown.
      newline = dataset.encode is not None and dataset.decode(dataset.encode('\n')) == '\n'
      ids, hidden = (dataset.encode('\n') if newline else np.zeros(1, np.int32)), 1
    encoded.append((prompt, np.asarray(ids, np.int32), hidden))
  longest = max(len(ids) for _, ids, _ in encoded)
  row_bytes = 4 * (longest + num_tokens + vocab_size)  # Its ids and one step's logits.
  host = memory.host_bytes_available()
  if host is not None and len(encoded) * num_samples * row_bytes > host:
    raise ConfigError(f'--num_samples: {len(encoded)} prompts x {num_samples} samples need '
                      f'{len(encoded) * num_samples * row_bytes / 2**30:.1f} GiB of host memory '
                      f'({row_bytes} B each), more than the {host / 2**30:.1f} GiB free; sample '
                      'fewer at a time')
  rows = [row for row in encoded for _ in range(num_samples)]
  setup = setup_lib.placed(config, dataset, mesh_shape, len(rows), 'sampling')
  fits = longest + num_tokens <= setup.model.max_len
  if decoding == 'cache' and not fits:
    raise ConfigError(f'--decoding: cache: prompt ({longest}) + --num_tokens ({num_tokens}) '
                      f"exceed the model's max_len of {setup.model.max_len}; generate fewer tokens "
                      'or give --decoding=recompute')
  cached = decoding == 'cache' or (decoding == 'auto' and fits)
  if not cached and len({len(ids) for _, ids, _ in rows}) > 1:
    raise ConfigError(f'--prompt: prompts of different lengths are decoded with the key/value '
                      f'cache, which holds max_len = {setup.model.max_len} tokens; generate fewer '
                      'tokens or give prompts of one length')
  logging.info('sampling %d rows on mesh %s (%d devices), %s', len(rows), dict(setup.mesh.shape),
               setup.mesh.size, 'key/value cache' if cached else 'recomputing each window')
  replicated = jax.sharding.NamedSharding(setup.mesh, jax.sharding.PartitionSpec())
  pad_B = np.array([longest - len(ids) for _, ids, _ in rows], np.int32)
  prompts_BP = np.zeros((len(rows), longest), np.int32)
  for b, (_, ids, _) in enumerate(rows):
    prompts_BP[b, pad_B[b]:] = ids
  options = dict(temperature=temperature, top_k=top_k, top_p=top_p)
  with setup.scope():
    params, step, _ = checkpoint.restore_params(directory, setup.abstract_state().params,
                                                field='--workdir')
    logging.info('restored params from step %d of %s', step, directory)
    if cached:
      gen = setup.jit(decode.generate_cached, setup.model, num_tokens=num_tokens, **options,
                      out_shardings=replicated)
      out_BT = np.asarray(gen(params, prompts_BP, pad_B, rng=jax.random.key(seed)))
    else:
      tokens_BT = np.concatenate([prompts_BP, np.zeros((len(rows), num_tokens), np.int32)], 1)
      gen = setup.jit(decode.generate, setup.model.apply, prompt_len=longest,
                      window=setup.model.max_len, **options, out_shardings=replicated)
      out_BT = np.asarray(gen({'params': params}, tokens_BT, rng=jax.random.key(seed)))
  samples = []
  for (prompt, ids, hidden), row in zip(rows, out_BT):
    new = row[longest:]
    shown = dataset.decode(np.concatenate([ids[hidden:], new]))
    samples.append({'prompt': prompt, 'text': dataset.decode(new), 'prompt_ids': ids.tolist(),
                    'ids': new.tolist(), 'sample': shown})
  return samples


def generate_text(workdir: str, prompt: str = '', num_chars: int = 200, temperature: float = 0.8,
                  top_k: int = 0, num_samples: int = 1, seed: int = 0, mesh_shape: str = '',
                  **kwargs) -> list[str]:
  """One prompt's samples as text: the prompt followed by `num_chars` generated tokens."""
  if num_chars <= 0:
    raise ConfigError(f'--num_chars: must be positive, got {num_chars}')
  return [s['sample'] for s in generate(workdir, [prompt], num_chars, temperature, top_k,
                                        num_samples=num_samples, seed=seed, mesh_shape=mesh_shape,
                                        **kwargs)]
