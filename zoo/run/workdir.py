"""What a run's workdir (a directory or a gs:// bucket path) holds, for the tools that read
one (zoo.sample, zoo.convert): its config, its checkpoints and the data or tokenizer that
encodes its text."""
import json
import os
from typing import Any

import ml_collections

from zoo import data, models
from zoo.data import tokens
from zoo.data.dataset import Dataset
from zoo.errors import CheckpointError, ConfigError
from zoo.run import tasks
from zoo.store import checkpoint, storage

TOKENIZER = 'tokenizer.json'  # An imported model's own tokenizer, beside its config.


def read_json(path: str, flag: str) -> Any:
  """A JSON file that `flag` pointed at; ConfigError naming both if it does not parse."""
  try:
    return json.loads(storage.read_text(path))
  except ValueError as e:
    raise ConfigError(f'{flag}: {path} is not valid JSON ({e})') from None


def load_run(workdir: str, require_lm: bool = True) -> tuple[ml_collections.ConfigDict, str]:
  """The run's config (a ConfigDict, tuples read back as lists) and its checkpoint directory.

  Checks that the run has a complete checkpoint and (`require_lm`) trained a language model.
  """
  if storage.is_remote(workdir):
    storage.check_bucket(workdir, '--workdir')
  if not storage.path(workdir).is_dir():
    raise ConfigError(f'--workdir: {workdir} is not a directory; give the workdir of a training '
                      'run')
  path = storage.join(workdir, 'config.json')
  if not storage.path(path).is_file():
    raise ConfigError(f'--workdir: {workdir} has no config.json; give the workdir of a training '
                      'run')
  raw = read_json(path, '--workdir')
  if not isinstance(raw, dict) or not isinstance(raw.get('model'), dict) or not isinstance(
      raw.get('data'), dict):
    raise ConfigError(f'--workdir: {path} is not the config of a zoo run (no model and data '
                      'sections); give the workdir of a training run, or import a Hugging Face '
                      'directory first (python -m zoo.convert import)')
  config = ml_collections.ConfigDict(raw)
  name = config.model.get('name')
  if require_lm and (name not in models.MODELS
                     or models.MODELS[name].task != tasks.LanguageModel.name):
    raise ConfigError(f'--workdir: {workdir} trained model {name!r}, not a language model; '
                      'give a transformer_lm run')
  if config.data.get('path') and not storage.path(config.data.path).exists():
    raise ConfigError(f'--workdir: the run trained on data.path={config.data.path}, not found from '
                      f'{os.getcwd()}; run from the directory that training ran in')
  directory = checkpoint.directory_of(workdir)
  if not any(d.isdigit() for d in storage.listdir(directory)):
    raise CheckpointError(f'--workdir: {workdir} has no complete checkpoint yet; train it first')
  return config, directory


def run_dataset(workdir: str, config: ml_collections.ConfigDict) -> Dataset:
  """The data that encodes prompts for a run: an imported model's own tokenizer.json (it has
  no dataset), else the run's dataset."""
  tokenizer_file = storage.join(workdir, TOKENIZER)
  if storage.is_file(tokenizer_file) and not config.data.get('path'):
    return tokens.tokenizer_dataset(tokenizer_file, config.model.vocab_size, config.data.seq_len)
  return data.load(config.data, config.seed)


def tokenizer_file(workdir: str, config: ml_collections.ConfigDict) -> str:
  """The run's tokenizer.json (its own, or its token dataset's), or '' if it has none."""
  data_path = config.data.get('path') or ''
  for path in [storage.join(workdir, TOKENIZER)] + (
      [storage.join(data_path, TOKENIZER)] if data_path else []):
    if storage.is_file(path):
      return path
  return ''
