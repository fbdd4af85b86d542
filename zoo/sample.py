r"""Generates text from a language-model run: `python -m zoo.sample --workdir=DIR`.

    python -m zoo.sample --workdir=runs/char_lm --prompt='The ' --num_chars=300

Reads the run's config.json and its newest checkpoint (params only) onto the devices
present, whatever mesh trained it, and prints each sample (prompt + continuation) to
stdout; logs go to stderr. An empty prompt starts from a newline (token 0 if the
vocabulary has none), which is not printed. Beyond the model's max_len the context slides.
The default mesh puts every device on the 'model' axis; if the parameters do not split
that way, sampling runs on one device. The same --seed gives the same text on any mesh.
For `npz` token data (no characters), the prompt and the output are token ids separated
by spaces.
"""
import functools
import json
import math
import os
import sys

from typing import Any

from absl import app
from absl import flags
from absl import logging
import jax
import ml_collections
import numpy as np

from zoo import checkpoint, data, distributed, models, sharding, tasks
from zoo import setup as setup_lib
from zoo.data.dataset import Dataset
from zoo.errors import CheckpointError, ConfigError, ZooError

_WORKDIR = flags.DEFINE_string('workdir', None, 'Workdir of a transformer_lm training run.')
_PROMPT = flags.DEFINE_string('prompt', '', 'Text to continue (empty: start from a newline).')
_NUM_CHARS = flags.DEFINE_integer('num_chars', 200, 'Tokens (characters) to generate per sample.')
_TEMPERATURE = flags.DEFINE_float('temperature', 0.8, 'Softmax temperature; 0 is greedy.')
_TOP_K = flags.DEFINE_integer('top_k', 0, 'Sample among the k likeliest tokens; 0: all.')
_NUM_SAMPLES = flags.DEFINE_integer(
    'num_samples', 1, 'Independent samples, generated as one batch.')
_SEED = flags.DEFINE_integer('seed', 0, 'Sampling seed: the same seed gives the same text.')
_MESH_SHAPE = flags.DEFINE_string(
    'mesh_shape', '', "Mesh over the run's mesh axes, e.g. '1,8' or '-1,1'. Empty: every device on "
    "'model' if the parameters split that way, else one device.")
_CPU_DEVICES = flags.DEFINE_integer(
    'cpu_devices', None, 'Run on this many emulated CPU devices (try a mesh without accelerators).')
flags.mark_flags_as_required(['workdir'])


def load_run(workdir: str) -> tuple[ml_collections.ConfigDict, str]:
  """The run's config (a ConfigDict, tuples read back as lists) and its checkpoint directory.

  Checks that the run trained a language model and has a complete checkpoint.
  """
  if not os.path.isdir(workdir):
    raise ConfigError(f'--workdir: {workdir} is not a directory; give the workdir of a training '
                      'run')
  path = os.path.join(workdir, 'config.json')
  if not os.path.isfile(path):
    raise ConfigError(f'--workdir: {workdir} has no config.json; give the workdir of a training '
                      'run')
  try:
    with open(path, encoding='utf-8') as f:
      config = ml_collections.ConfigDict(json.load(f))
  except ValueError as e:
    raise ConfigError(f'--workdir: {path} is not valid JSON ({e})') from None
  name = config.model.get('name')
  if name not in models.MODELS or models.MODELS[name].task != tasks.LanguageModel.name:
    raise ConfigError(f'--workdir: {workdir} trained model {name!r}, not a language model; '
                      'sampling needs a transformer_lm run')
  if config.data.get('path') and not os.path.exists(config.data.path):
    raise ConfigError(f'--workdir: the run trained on data.path={config.data.path}, not found from '
                      f'{os.getcwd()}; run from the directory that training ran in')
  directory = checkpoint.directory_of(workdir)
  if not os.path.isdir(directory) or not any(d.isdigit() for d in os.listdir(directory)):
    raise CheckpointError(f'--workdir: {workdir} has no complete checkpoint yet; train it first')
  return config, directory


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


def _parse_mesh_shape(text, axes, num_devices):
  try:
    shape = tuple(int(s) for s in text.split(','))
  except ValueError:
    raise ConfigError(f'--mesh_shape: {text!r} is not comma-separated integers, e.g. '
                      f'\'1,{num_devices}\'') from None
  return sharding.check_mesh_shape(shape, axes, num_devices, field='--mesh_shape')


def _fits(logical_params, mesh, rules):
  """Whether every sharded parameter dimension divides over its mesh axes."""
  return all(None not in row['shard_shape']
             for row in sharding.param_table(logical_params, mesh, rules))


def choose_mesh(mesh_shape: str, axes: tuple, logical_params: Any,
                rules: tuple) -> jax.sharding.Mesh:
  """The mesh to sample on: --mesh_shape, else every device on 'model', else one device."""
  devices = jax.devices()
  if mesh_shape:
    mesh = sharding.make_mesh(_parse_mesh_shape(mesh_shape, axes, len(devices)), axes, devices)
    if not _fits(logical_params, mesh, rules):
      raise ConfigError(f'--mesh_shape: the parameters do not split over the mesh '
                        f'{dict(mesh.shape)} '
                        'under the run\'s logical_axis_rules; choose other sizes')
    return mesh
  if 'model' in axes:
    mesh = sharding.make_mesh([len(devices) if a == 'model' else 1 for a in axes], axes, devices)
    if _fits(logical_params, mesh, rules):
      return mesh
  logging.warning('the parameters do not split over %d devices on the model axis; sampling on '
                  'one device (set --mesh_shape to choose)', len(devices))
  return sharding.make_mesh([1] * len(axes), axes, devices[:1])


def generate_text(workdir: str, prompt: str = '', num_chars: int = 200, temperature: float = 0.8,
                  top_k: int = 0, num_samples: int = 1, seed: int = 0,
                  mesh_shape: str = '') -> list[str]:
  """Samples from the newest checkpoint of `workdir`; returns one string per sample.

  Each string is the prompt followed by `num_chars` generated tokens, decoded. Bad input
  raises ZooError before anything compiles.
  """
  for flag, value in (('num_chars', num_chars), ('num_samples', num_samples)):
    if value <= 0:
      raise ConfigError(f'--{flag}: must be positive, got {value}')
  if temperature < 0:
    raise ConfigError(f'--temperature: must be >= 0 (0 is greedy), got {temperature}')
  config, directory = load_run(workdir)
  dataset = data.load(config.data, config.seed)
  vocab_size = dataset.model_fields['vocab_size']
  if not 0 <= top_k <= vocab_size:
    raise ConfigError(f'--top_k: must be in [0, {vocab_size}] (the vocabulary), got {top_k}')

  prompt_T = encode_prompt(dataset, prompt, vocab_size)
  start = 0
  if not len(prompt_T):  # Nothing to continue: start from a newline (or token 0), not printed.
    newline = dataset.encode is not None and dataset.decode(dataset.encode('\n')) == '\n'
    prompt_T, start = (dataset.encode('\n') if newline else np.zeros(1, np.int32)), 1
  tokens_BT = np.zeros((num_samples, len(prompt_T) + num_chars), np.int32)
  tokens_BT[:, :len(prompt_T)] = prompt_T

  setup = _sampling_setup(config, dataset, mesh_shape, num_samples)
  logging.info('sampling on mesh %s (%d devices)', dict(setup.mesh.shape), setup.mesh.size)
  replicated = jax.sharding.NamedSharding(setup.mesh, jax.sharding.PartitionSpec())
  with setup.scope():
    params, step, _ = checkpoint.restore_params(directory, setup.abstract_state().params,
                                                field='--workdir')
    logging.info('restored params from step %d of %s', step, directory)
    gen = jax.jit(functools.partial(
        tasks.generate, setup.model.apply, prompt_len=len(prompt_T), window=setup.model.max_len,
        temperature=temperature, top_k=top_k), out_shardings=replicated)
    out_BT = np.asarray(gen({'params': params}, tokens_BT, rng=jax.random.key(seed)))
  return [dataset.decode(row[start:]) for row in out_BT]


def _sampling_setup(config: ml_collections.ConfigDict, dataset: Dataset, mesh_shape: str,
                    num_samples: int) -> setup_lib.Setup:
  """The run's Setup on the sampling mesh (choose_mesh); the samples are replicated where
  they do not divide over the batch shards."""
  axes = tuple(config.mesh.axes)
  one_device = sharding.make_mesh([1] * len(axes), axes, jax.devices()[:1])
  logical = setup_lib.build(config, dataset, mesh=one_device)  # For the parameters' names.
  mesh = choose_mesh(mesh_shape, axes, logical.logical_state.params, logical.rules)
  rules = logical.rules
  if num_samples % math.prod(mesh.shape[a] for a in sharding.batch_mesh_axes(rules)):
    rules = [(name, None if name == 'act_batch' else axis) for name, axis in rules]  # Replicate.
  return setup_lib.build(config, dataset, mesh=mesh, rules=rules)


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    sys.exit(f'zoo: error: unexpected arguments {argv[1:]}')
  try:
    distributed.initialize(cpu_devices=_CPU_DEVICES.value)
    logging.info('JAX %s, %d devices: %s', jax.__version__, jax.device_count(), jax.devices())
    samples = generate_text(_WORKDIR.value, _PROMPT.value, _NUM_CHARS.value, _TEMPERATURE.value,
                            _TOP_K.value, _NUM_SAMPLES.value, _SEED.value, _MESH_SHAPE.value)
  except ZooError as e:
    sys.exit(f'zoo: error: {e}')
  if jax.process_index() == 0:
    for i, text in enumerate(samples):
      if len(samples) > 1:
        print(('\n' if i else '') + f'=== sample {i + 1} of {len(samples)} ===')
      print(text)


if __name__ == '__main__':
  app.run(main)
