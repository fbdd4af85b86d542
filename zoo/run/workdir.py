"""A finished run, read from its workdir (zoo.store.workdir.Workdir: a directory or a gs://
bucket path) by the tools that use one (zoo.sample, zoo.convert export, zoo.evaluate): its
config, checked as training checks it, its checkpoints, and the data or tokenizer that
encodes its text."""
import os
from typing import Union

import ml_collections

from zoo import data, models
from zoo.data import tokens
from zoo.data.dataset import Dataset
from zoo.errors import CheckpointError, ConfigError
from zoo.run import config as cfg
from zoo.run import tasks
from zoo.store import storage
from zoo.store.workdir import Workdir

TOKENIZER = Workdir.TOKENIZER
# Beside tokenizer.json, what a Hugging Face tokenizer directory may hold that chat
# formatting reads (the chat template and the special tokens' strings): kept on import,
# written on export.
TOKENIZER_EXTRAS = ('tokenizer_config.json', 'chat_template.jinja', 'special_tokens_map.json')


def load_run(workdir: Union[str, Workdir], require_lm: bool = True
             ) -> tuple[ml_collections.ConfigDict, str]:
  """The run's config (a ConfigDict, tuples read back as lists) and its checkpoint directory.

  Checks the config's model section as training does, that the run has a complete
  checkpoint and (`require_lm`) that it trained a language model.
  """
  workdir = Workdir(workdir)
  workdir.check_readable()
  if not workdir.has(Workdir.CONFIG):
    raise ConfigError(f'--workdir: {workdir} has no config.json; give the workdir of a training '
                      'run')
  path = workdir.join(Workdir.CONFIG)
  raw = workdir.read_json(Workdir.CONFIG)
  if not isinstance(raw, dict) or not isinstance(raw.get('model'), dict) or not isinstance(
      raw.get('data'), dict):
    raise ConfigError(f'--workdir: {path} is not the config of a zoo run (no model and data '
                      'sections); give the workdir of a training run, or import a Hugging Face '
                      'directory first (python -m zoo.convert import)')
  config = ml_collections.ConfigDict(raw)
  try:  # The model section, as training checks it (the run is placed anew: no mesh check).
    cfg.validate_model(config.model)
  except ConfigError as e:
    raise ConfigError(f'--workdir: {path}: {e}; fix the file or give another run') from None
  name = config.model.get('name')
  if require_lm and models.MODELS[name].task != tasks.LanguageModel.name:
    raise ConfigError(f'--workdir: {workdir} trained model {name!r}, not a language model; '
                      'give a transformer_lm run')
  if config.data.get('path') and not storage.path(config.data.path).exists():
    raise ConfigError(f'--workdir: the run trained on data.path={config.data.path}, not found from '
                      f'{os.getcwd()}; run from the directory that training ran in')
  if not any(d.isdigit() for d in storage.listdir(workdir.checkpoints)):
    raise CheckpointError(f'--workdir: {workdir} has no complete checkpoint yet; train it first')
  return config, workdir.checkpoints


def run_dataset(workdir: Union[str, Workdir], config: ml_collections.ConfigDict) -> Dataset:
  """The data that encodes prompts for a run: an imported model's own tokenizer.json (it has
  no dataset), else the run's dataset."""
  workdir = Workdir(workdir)
  if workdir.has(TOKENIZER) and not config.data.get('path'):
    return tokens.tokenizer_dataset(workdir.join(TOKENIZER), config.model.vocab_size,
                                    config.data.seq_len)
  return data.load(config.data, config.seed)


def tokenizer_file(workdir: Union[str, Workdir], config: ml_collections.ConfigDict) -> str:
  """The run's tokenizer.json (its own, or its token dataset's), or '' if it has none."""
  data_path = config.data.get('path') or ''
  for path in [Workdir(workdir).join(TOKENIZER)] + (
      [storage.join(data_path, TOKENIZER)] if data_path else []):
    if storage.is_file(path):
      return path
  return ''
