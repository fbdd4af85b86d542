"""The config every experiment starts from, and its validation before anything compiles.

Public keys (a stable contract, see docs/configuration.md): model.name and the model's fields,
data.name, mesh.axes, mesh.shape, logical_axis_rules, train.steps, train.batch_size,
seed, optimizer.*, eval.every_steps.
"""
import dataclasses
import importlib.util
import json
import math
import os
import typing
from typing import Any, Optional

import jax
import ml_collections
from ml_collections import config_dict
import numpy as np

from zoo import data, models
from zoo.data import choice
from zoo.data.dataset import Dataset
from zoo.errors import ConfigError, fail, first_line
from zoo.models import lora as lora_lib
from zoo.parallel import mesh as mesh_lib
from zoo.parallel import sharding
from zoo.run import optim, tasks
from zoo.store import metrics, storage

WANDB_MODES = ('', 'online', 'offline', 'disabled')
LAYER_FIELDS = ('num_layers', 'num_encoder_layers', 'num_decoder_layers', 'stage_sizes')
INDEX_FIELDS = ('dense_layers',)  # Model fields that list layers, not sizes.
MAX_LAYERS = 1024


def base_config() -> ml_collections.ConfigDict:
  """Defaults shared by all experiments; an experiment sets model, data and sizes."""
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.model = ml_collections.ConfigDict()   # name + the model's constructor fields.
  c.data = ml_collections.ConfigDict()    # name + the loader's options.
  c.data.name = 'digits'
  c.data.path = ''                        # text: a UTF-8 file (empty: bundled); npz: required.
  c.data.prefetch = 4                     # Train batches built and put on devices ahead (0: none).
  c.data.augment = ''                     # records: 'crop', 'flip' or 'crop,flip'; '': none.
  c.data.workers = 0                      # records: decoding processes (0: the prefetch thread).
  c.data.windows = 'documents'            # tokens: packed documents, or 'stream' (zoo.data.tokens).
  c.mesh = ml_collections.ConfigDict()
  c.mesh.axes = sharding.MESH_AXES
  c.mesh.shape = (-1, 1)                  # One entry may be -1: filled from the device count.
  c.mesh.dcn_shape = (1, 1)               # Multi-slice TPU: slices per axis (put them on 'batch').
  c.logical_axis_rules = sharding.standard_rules()
  c.train = ml_collections.ConfigDict()
  c.train.steps = 1000
  c.train.batch_size = 128                # Global, over all processes and devices.
  c.train.log_every_steps = 50
  c.train.microbatches = 1                # Gradient accumulation: k microbatches per step.
  c.optimizer = ml_collections.ConfigDict()
  c.optimizer.name = 'adamw'              # One of optim.OPTIMIZERS.
  c.optimizer.learning_rate = 1e-3        # Peak, reached after warmup.
  c.optimizer.schedule = 'cosine'         # After warmup: constant, cosine or linear decay to 0.
  c.optimizer.warmup_steps = 0
  c.optimizer.weight_decay = 0.0          # Decoupled; matrices only.
  c.optimizer.grad_clip_norm = 1.0        # <= 0 disables clipping.
  c.optimizer.b1 = 0.9
  c.optimizer.b2 = 0.999
  c.optimizer.momentum = 0.9              # sgd only.
  c.eval = ml_collections.ConfigDict()
  c.eval.every_steps = 200                # Also evaluates after the last step.
  c.eval.batch_size = 128                 # Global; the last batch is padded and masked.
  c.eval.max_batches = 0                  # 0: the whole eval split.
  c.eval.sample = True                    # LM only: print a sample at each eval (one forward
                                          # a token over the window: on long ones, slow).
  c.eval.sample_temperature = 0.8         # The sample's; 0 is greedy.
  c.eval.choice_tasks = ()                # LM only: multiple-choice tasks (zoo.data.choice).
  c.metrics = ml_collections.ConfigDict()  # metrics.jsonl and TensorBoard always; W&B if set.
  c.metrics.wandb_project = ''            # A W&B project: rows, config, samples (`.[wandb]`).
  c.metrics.wandb_entity = ''             # W&B team or user ('': the default).
  c.metrics.wandb_mode = ''               # online, offline (`wandb sync` later), disabled; '':
                                          # W&B's own WANDB_MODE, else online.
  c.profile = ml_collections.ConfigDict()
  c.profile.steps = ()                    # (a, b): trace steps [a, b) into workdir/profile.
  c.perf = ml_collections.ConfigDict()
  c.perf.peak_flops_per_device = 0.0      # For MFU; 0: the device's data sheet (CPU: measured).
  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every_steps = 1000         # Also saved after the last step and on SIGTERM.
  c.checkpoint.keep = 3                   # Newest complete checkpoints kept in workdir/checkpoints.
  c.checkpoint.async_save = True          # Write in the background while training goes on.
  c.checkpoint.init_from = ''             # A run's workdir or checkpoints/: start from its params.
  c.checkpoint.fallback = False           # Newest checkpoint damaged: resume from an older one.
  c.checkpoint.lease_seconds = 60.0       # The workdir's owner renews its lease; after this much
                                          # silence (a lost host) another job may take over, and
                                          # a run whose storage stopped answering ends.
  # False: each shard is written once, by its first replica (fastest on one host: the loop
  # is blocked ~4x less on CPU). True: replicas split the write, which pays off only when
  # many hosts hold copies of large replicated arrays.
  c.checkpoint.replica_parallel = False
  c.dpo = ml_collections.ConfigDict()     # Preference pairs (zoo.run.tasks.Preference).
  c.dpo.beta = 0.1                        # How far from the reference: larger, closer.
  c.dpo.loss = 'sigmoid'                  # sigmoid (DPO; cDPO with label_smoothing) or ipo.
  c.dpo.label_smoothing = 0.0             # sigmoid: the chance a pair's label is flipped.
  c.grpo = ml_collections.ConfigDict()    # Prompts: zoo.run.rollouts, tasks.PolicyGradient.
  c.grpo.rewards = ()                     # ('module:function', ...): zoo.data.rewards.
  c.grpo.reward_weights = ()              # One per reward; (): all 1.
  c.grpo.num_generations = 8              # Completions per prompt (train.batch_size counts them).
  c.grpo.max_completion_tokens = 32       # Each completion's budget (its stop token included).
  c.grpo.temperature = 1.0                # Sampling, and the log-probabilities trained on.
  c.grpo.top_k = 0                        # 0: off.
  c.grpo.top_p = 1.0                      # 1: off.
  c.grpo.scale_rewards = 'group'          # Advantages over the group's std, 'batch''s, 'none'.
  c.grpo.loss = 'dapo'                    # dapo (= bnpo here), grpo or dr_grpo aggregation.
  c.grpo.epsilon = 0.2                    # The ratio's clip below 1 ...
  c.grpo.epsilon_high = 0.0               # ... and above (0: epsilon; DAPO's clip-higher: 0.28).
  c.grpo.beta = 0.0                       # k3 KL to the reference; 0: none held.
  c.grpo.kl_correction = True             # The KL term times the ratio: its gradient unbiased.
  c.grpo.num_iterations = 1               # Updates per rollout (> 1: old log-probs kept).
  c.grpo.importance = 'token'             # 'sequence': GSPO's sequence-level ratio.
  c.grpo.mask_truncated = False           # Completions that hit the budget train on nothing.
  return c


# Module fields that are not config keys: Linen's own, and the decoding switch and cache
# length that zoo.models.decode sets.
_NOT_KEYS = ('parent', 'name', 'decode', 'cache_length')


def model_config(name: str, **fields) -> ml_collections.ConfigDict:
  """config.model for family `name`: `fields`, then every other field its module declares
  with a default (the documented model keys), so that a command line can set any of them.
  A field given as None ("the data's") is a placeholder of the module's type for it, which
  `--config.model.X=` can still set. `lora` gets every projection of the model's MLP as its
  targets, at rank 0 (none)."""
  values = {'name': name, **fields}
  if name not in models.MODELS:  # validate_model names the field.
    return ml_collections.ConfigDict(values)
  module = models.MODELS[name].module
  for f in dataclasses.fields(module):
    if f.name in values or f.name in _NOT_KEYS or f.default is dataclasses.MISSING:
      continue
    values[f.name] = f.default
  declared = typing.get_type_hints(module)
  for key, value in values.items():
    if value is None and key in declared:
      values[key] = config_dict.placeholder(_not_none(declared[key]))
  if isinstance(values.get('lora'), lora_lib.Lora):
    values['lora'] = _lora(values, rank=0, alpha=0.0)
  return ml_collections.ConfigDict(values)


def _not_none(annotation: Any) -> type:
  """int of Optional[int]; the annotation itself otherwise."""
  args = [a for a in typing.get_args(annotation) if a is not type(None)]
  return args[0] if typing.get_origin(annotation) is typing.Union and len(args) == 1 else (
      annotation)


def _lora(model: Any, rank: int, alpha: float) -> ml_collections.ConfigDict:
  """config.model.lora adapting every projection the model (its fields) has adapters for:
  its attention's and its MLP's, but a model with routed experts only its attention's."""
  gated = model.get('mlp_activation') in ('swiglu', 'geglu')
  mlp = () if model.get('num_experts') else ('wi_gate', 'wi_up', 'wo') if gated else ('wi', 'wo')
  return ml_collections.ConfigDict(dict(rank=rank, alpha=alpha, dropout=0.0,
                                        targets=('query', 'key', 'value', 'out') + mlp))


def imported_model(workdir: str, experiment: str, lora_rank: int = 0
                   ) -> ml_collections.ConfigDict:
  """base_config() with the model of an imported workdir (its config.json's fields, and the
  family's defaults for those it leaves out: model_config),
  its params as the starting point (checkpoint.init_from; the optimizer fresh) and
  config.model.lora for every projection the model has at `lora_rank` (0: none). What the
  fine-tuning experiments start from; `experiment` names the file in errors."""
  found = storage.join(workdir, 'config.json')  # A local or gs:// workdir.
  if not storage.is_file(found):
    raise ValueError(f'{workdir} has no config.json: give the workdir of an imported model '
                     '(python -m zoo.convert import --hf_dir=... --workdir=WORKDIR), '
                     f'--config=experiments/{experiment}.py:WORKDIR[,smoke]')
  c = base_config()
  model = dict(json.loads(storage.read_text(found))['model'])
  c.model = model_config(model.pop('name', None), **model)
  c.model.lora = _lora(c.model, rank=lora_rank, alpha=2.0 * lora_rank)
  c.checkpoint.init_from = workdir
  c.data.name = 'tokens'
  c.data.path = ''  # A dataset made with the model's tokenizer: --config.data.path.
  c.data.seq_len = min(128, c.model.max_len)
  return c


def load_experiment(path: str, arg: Optional[str] = None) -> ml_collections.ConfigDict:
  """`get_config(arg)` of an experiment file (what --config=PATH:ARG loads). A file that is
  missing, does not parse, or whose get_config raises is a ConfigError naming it and where."""
  name = f'{path}:{arg}' if arg is not None else path
  if not os.path.isfile(path):
    known = sorted(f for f in os.listdir(os.path.dirname(path) or '.') if f.endswith('.py')) if (
        os.path.isdir(os.path.dirname(path) or '.')) else []
    raise ConfigError(f'--config: {path}: no such experiment file' + (
        f'; {os.path.dirname(path) or "."}/ has {", ".join(known)}' if known else ''))
  if not path.endswith('.py'):
    raise ConfigError(f'--config: {path}: an experiment file is Python source ending in .py')
  spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3] or 'experiment', path)
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except SyntaxError as e:
    raise ConfigError(f'--config: {path}, line {e.lineno}: {e.msg}; fix the file') from None
  except Exception as e:  # pylint: disable=broad-except  # The user's file: any error.
    raise ConfigError(f'--config: {path}: importing it raised {_where(e, path)}') from None
  if not callable(getattr(module, 'get_config', None)):
    raise ConfigError(f'--config: {path} defines no get_config(arg); an experiment file returns '
                      'its ConfigDict from get_config (see experiments/)')
  try:
    config = module.get_config(arg)
  except Exception as e:  # pylint: disable=broad-except
    raise ConfigError(f'--config: {name}: get_config raised {_where(e, path)}') from None
  if not isinstance(config, ml_collections.ConfigDict):
    raise ConfigError(f'--config: {name}: get_config returned {type(config).__name__}, not an '
                      'ml_collections.ConfigDict (start from zoo.run.config.base_config())')
  return config


def _where(e: Exception, path: str) -> str:
  """`Type: message (file, line N)`: the exception and its deepest frame in `path`."""
  import traceback  # pylint: disable=import-outside-toplevel
  frames = [f for f in traceback.extract_tb(e.__traceback__)
            if os.path.abspath(f.filename) == os.path.abspath(path)]
  text = first_line(e)
  return f'{type(e).__name__}: {text}' + (f' (line {frames[-1].lineno})' if frames else '')


def from_flag(holder: Any) -> ml_collections.ConfigDict:
  """The --config flag's ConfigDict. ml_collections defers a file's error to the first
  use of the config and hides its cause: the file is loaded again here to name it."""
  try:
    value = holder.value
    error = None if isinstance(value, ml_collections.ConfigDict) else 'the file did not load'
  except Exception as e:  # pylint: disable=broad-except
    error = first_line(e, type(e).__name__)
  if error is None:
    return value
  from absl import flags  # pylint: disable=import-outside-toplevel
  path, _, arg = flags.FLAGS[holder.name].config_filename.partition(':')
  load_experiment(path, arg or None)  # Raises the ConfigError that names the problem.
  raise ConfigError(f'--config: {error}')


def validate(config: ml_collections.ConfigDict, num_devices: int) -> None:
  """Raises ConfigError on the first bad field; needs only the config and device count.

  The run's own fields are checked here; each other owner checks its section: the model
  family and the data source (ModelFamily.check_config, DataSource.check_config), the mesh
  and its rules, the optimizer (optim.check_config).
  """
  validate_model(config.model)
  if config.data.get('name') not in data.DATASETS:
    fail('data.name', f'unknown dataset {config.data.get("name")!r}; '
         f'known: {", ".join(data.DATASETS)}')
  shape = mesh_lib.check_mesh_shape(config.mesh.shape, config.mesh.axes, num_devices,
                                    dcn_shape=config.mesh.dcn_shape)
  _validate_rules(config.logical_axis_rules, config.mesh.axes)
  _check_every_axis_is_used(config.logical_axis_rules, config.mesh.axes, shape)
  family, source = models.MODELS[config.model.name], data.DATASETS[config.data.name]
  if source.task is not None and family.task != tasks.model_task(source.task):
    fail('data.name', f'model {config.model.name!r} trains on {family.task} data but '
         f'{config.data.name!r} is {source.task} data; pick a matching model or dataset')
  if 'seq_len' in config.data and config.data.seq_len <= 0:
    fail('data.seq_len', f'must be positive, got {config.data.seq_len}')
  source.check_config(config.data)
  _validate_run(config)
  _validate_dpo(config.dpo)
  _validate_grpo(config)
  for field in ('train.steps', 'train.batch_size', 'train.log_every_steps',
                'eval.every_steps', 'eval.batch_size', 'checkpoint.every_steps', 'checkpoint.keep',
                'checkpoint.lease_seconds'):
    group, key = field.split('.')
    if config[group][key] <= 0:
      fail(field, f'must be positive, got {config[group][key]}')
  optim.check_config(config.optimizer)
  _validate_batch_sizes(config, num_devices)


def validate_model(model: ml_collections.ConfigDict) -> None:
  """config.model alone: a known family, positive sizes, a buildable depth, then the
  family's own check. What a run placed from its workdir (zoo.sample, zoo.convert export,
  zoo.evaluate) is checked by; `validate` starts with it."""
  if model.get('name') not in models.MODELS:
    fail('model.name', f'unknown model {model.get("name")!r}; known: {", ".join(models.MODELS)}')
  unset = {f.name for f in dataclasses.fields(models.MODELS[model.name].module)
           if f.default == 0 and not isinstance(f.default, bool)}  # 0: derived (head_dim).
  for key, value in model.items():
    values = value if isinstance(value, (tuple, list)) else (value,)
    if key in INDEX_FIELDS:  # Layer numbers, from 0: the family checks them.
      continue
    if any(isinstance(v, int) and not isinstance(v, bool) and (v < 0 or v == 0 and key not in unset)
           for v in values):
      fail(f'model.{key}', f'sizes must be positive, got {value}' + (
          ' (or 0: derived from the others)' if key in unset else ''))
    if key in LAYER_FIELDS and sum(values) > MAX_LAYERS:  # Tracing them would take hours.
      fail(f'model.{key}', f'{value}: more than the {MAX_LAYERS} layers zoo builds (the deepest '
           'published Transformers have ~130); lower it')
  models.MODELS[model.name].check_config(model)


def _validate_run(config):
  """Seed, profiling, prefetch, peak, eval sizes and W&B."""
  if config.metrics.wandb_mode not in WANDB_MODES:
    fail('metrics.wandb_mode', f'unknown mode {config.metrics.wandb_mode!r}; known: '
         f'{", ".join(m for m in WANDB_MODES if m)}, or \'\' (W&B\'s own WANDB_MODE)')
  if config.metrics.wandb_project and importlib.util.find_spec('wandb') is None:
    fail('metrics.wandb_project', "needs the wandb package: pip install -e '.[wandb]'")
  if (config.metrics.wandb_project and jax.process_index() == 0  # Only process 0 logs to W&B.
      and not metrics.wandb_logged_in(config.metrics.wandb_mode)):
    fail('metrics.wandb_project', f'{config.metrics.wandb_project}: W&B has no login here (no '
         'WANDB_API_KEY, no `wandb login`); log in, or set WANDB_MODE=offline (sync later with '
         '`wandb sync`) or metrics.wandb_mode=offline')
  steps = tuple(config.profile.steps)
  if steps and not (len(steps) == 2 and 0 <= steps[0] < steps[1] <= config.train.steps):
    fail('profile.steps', f'{steps} must be () or (a, b) with 0 <= a < b <= train.steps='
         f'{config.train.steps}')
  if config.seed < 0:
    fail('seed', f'must be >= 0, got {config.seed}')
  if config.data.prefetch < 0:
    fail('data.prefetch', f'must be >= 0 (0: no prefetching), got {config.data.prefetch}')
  if config.perf.peak_flops_per_device < 0:
    fail('perf.peak_flops_per_device', f'must be >= 0 (0: look it up or measure it), got '
         f'{config.perf.peak_flops_per_device}')
  if not 0 <= config.eval.sample_temperature < float('inf'):  # (NaN fails too.)
    fail('eval.sample_temperature', f'must be a finite number >= 0 (0: greedy), got '
         f'{config.eval.sample_temperature}')
  if config.eval.max_batches < 0:
    fail('eval.max_batches',
         f'must be >= 0 (0: the whole eval split), got {config.eval.max_batches}')
  tasks_ = config.eval.get('choice_tasks', ())
  if isinstance(tasks_, str) or not all(isinstance(t, str) and t for t in tasks_):
    fail('eval.choice_tasks', f'must be a tuple of task files or names, e.g. '
         f"('numpy_line_order',), got {tasks_!r}")
  if len({choice.name_of(t) for t in tasks_}) != len(tasks_):
    fail('eval.choice_tasks', f'{tasks_!r} names a task twice; give each once (a task is named '
         'by its file name)')


def _validate_dpo(dpo):
  if not 0 < dpo.beta < float('inf'):
    fail('dpo.beta', f'must be a finite number > 0, got {dpo.beta}')
  if dpo.loss not in tasks.DPO_LOSSES:
    fail('dpo.loss', f'unknown loss {dpo.loss!r}; known: {", ".join(tasks.DPO_LOSSES)}')
  if not 0 <= dpo.label_smoothing < 0.5:
    fail('dpo.label_smoothing', f'must be in [0, 0.5) (the chance a pair\'s label is flipped), '
         f'got {dpo.label_smoothing}')


def _validate_grpo(config):
  """The GRPO section's values (always), and what a run on prompts needs of the rest."""
  g = config.grpo
  checks = (
      ('num_generations', g.num_generations >= 2, 'an integer >= 2 (a group needs two to compare)'),
      ('max_completion_tokens', g.max_completion_tokens >= 1, 'a positive integer'),
      ('temperature', 0 < g.temperature < float('inf'), 'a finite number > 0'),
      ('top_k', g.top_k >= 0, '>= 0 (0: off)'),
      ('top_p', 0 < g.top_p <= 1, 'in (0, 1] (1: off)'),
      ('epsilon', 0 < g.epsilon < 1, 'in (0, 1)'),
      ('epsilon_high', 0 <= g.epsilon_high < float('inf'), 'a finite number >= 0 (0: epsilon)'),
      ('beta', 0 <= g.beta < float('inf'), 'a finite number >= 0 (0: no reference)'),
      ('num_iterations', g.num_iterations >= 1, 'a positive integer'),
  )
  for key, ok, want in checks:
    if not ok:
      fail(f'grpo.{key}', f'must be {want}, got {g[key]}')
  for key, known in (('scale_rewards', tasks.REWARD_SCALES), ('loss', tasks.GRPO_LOSSES),
                     ('importance', tasks.IMPORTANCE_LEVELS)):
    if g[key] not in known:
      fail(f'grpo.{key}', f'unknown value {g[key]!r}; known: {", ".join(known)}')
  if config.data.name != 'prompts':
    return
  from zoo.data import rewards  # pylint: disable=import-outside-toplevel
  rewards.load(tuple(g.rewards), tuple(g.reward_weights))
  if config.train.batch_size % g.num_generations:
    fail('train.batch_size', f'{config.train.batch_size} completions do not split into groups of '
         f'grpo.num_generations={g.num_generations}; use a multiple of it')
  for field in ('train.steps', 'checkpoint.every_steps', 'eval.every_steps'):
    group, key = field.split('.')
    if config[group][key] % g.num_iterations:
      fail(field, f'{config[group][key]} is not a multiple of grpo.num_iterations='
           f'{g.num_iterations} (a run saves and evaluates between rollouts only)')


def _validate_batch_sizes(config, num_devices):
  """Global batches divide over the batch shards, and so do microbatches."""
  shape = mesh_lib.resolve_mesh_shape(config.mesh.shape, num_devices)
  axes = sharding.batch_mesh_axes(sharding.for_mesh(config.logical_axis_rules,
                                                    config.mesh.axes))
  batch_shards = math.prod(shape[config.mesh.axes.index(a)] for a in axes)
  for field in ('train.batch_size', 'eval.batch_size'):
    group, key = field.split('.')
    if config[group][key] % batch_shards:
      fail(field, f'{config[group][key]} is not divisible by the {batch_shards} shards of the '
           f'batch (mesh axes {axes}); use a multiple of {batch_shards}')
  k = config.train.microbatches
  if k <= 0 or config.train.batch_size % (k * batch_shards):
    fail('train.microbatches', f'{k}: train.batch_size={config.train.batch_size} must split into '
         f'{k} microbatches that each divide over the {batch_shards} batch shards; use a '
         f'positive divisor of {config.train.batch_size // batch_shards}')


def _validate_rules(rules, mesh_axes):
  for rule in rules:
    if len(rule) != 2:
      fail('logical_axis_rules', f'{tuple(rule)} is not a (logical name, mesh axis or None) pair')
    name, axis = rule
    if name not in sharding.LOGICAL_AXES:
      fail('logical_axis_rules', f'unknown logical axis {name!r}; '
           f'known: {", ".join(sharding.LOGICAL_AXES)}')
    for a in sharding.mesh_axes_of(axis):
      if a not in mesh_axes and a not in sharding.OPTIONAL_MESH_AXES:
        fail('logical_axis_rules', f'rule ({name!r}, {axis!r}) names mesh axis {a!r}, '
             f'but mesh.axes is {tuple(mesh_axes)}; add {a!r} to mesh.axes or change the rule')


def _check_every_axis_is_used(rules, mesh_axes, shape):
  """A mesh axis over several devices that no rule maps a logical axis onto would have every
  device along it compute the same rows: refused."""
  used = {a for _, axis in sharding.for_mesh(rules, mesh_axes) for a in sharding.mesh_axes_of(axis)}
  for axis, size in zip(mesh_axes, shape):
    if size > 1 and axis not in used:
      fail('mesh.axes', f'mesh axis {axis!r} ({size} devices) is named by no rule in '
           'logical_axis_rules, so every device along it would compute the same rows; map a '
           f'logical axis onto {axis!r} or leave it out of mesh.axes')


def validate_with_data(config: ml_collections.ConfigDict, dataset: Dataset,
                       plan: bool = False) -> None:
  """The loaded data fits the model: its task, the family's check of one example's inputs,
  and (unless this is a plan, which compiles for shapes alone: a pod's batch need not fit
  the corpus at hand) enough examples for a batch."""
  family = models.MODELS[config.model.name]
  if tasks.model_task(dataset.task) != family.task:
    fail('data.path', f'{config.data.path} holds {dataset.task} data but model '
         f'{config.model.name!r} trains on {family.task} data; pick a matching model or file')
  for key, needed in dataset.model_fields.items():
    if config.model.get(key) is not None and config.model[key] < needed:
      source = config.data.get('path') or config.data.name
      fail(f'model.{key}', f'{config.model[key]} is smaller than the {needed} that the data '
           f'({source}) needs; leave model.{key} out to take the data\'s, or give data that fits')
  if not plan and config.train.batch_size > dataset.num_train:
    fail('train.batch_size', f'{config.train.batch_size} exceeds the {dataset.num_train} '
         f'training examples of {config.data.name!r}')
  task = tasks.make(dataset.task, config)
  example = dataset.train_batch(0, 1, slice(0, 1))
  if task.name == 'grpo' and 'max_len' in config.model:
    prompt = example['prompt'].shape[1]
    if prompt + config.grpo.max_completion_tokens > config.model.max_len:
      fail('grpo.max_completion_tokens', f'{config.grpo.max_completion_tokens} tokens after '
           f'prompts of {prompt} (data.seq_len, or the longest prompt) pass model.max_len='
           f'{config.model.max_len}; lower it or data.seq_len')
  family.check_inputs(config.model, task.model_inputs(task.train_example(example)))
  if config.eval.get('choice_tasks') and dataset.encode is None:
    fail('eval.choice_tasks', f'multiple-choice tasks score text, but {config.data.name!r} data '
         'has no tokenizer; train a language model on text or tokens')


def validate_sequence_split(task: tasks.Task, example: dict, mesh: jax.sharding.Mesh,
                            rules: tuple) -> None:
  """Where the rules split sequences over the mesh (context parallelism), the task's inputs
  are sequences whose lengths split evenly: into 2 x shards chunks where its batches are
  fed load-balanced (zoo.parallel.context), else into shards."""
  shards = sharding.sequence_shards(mesh, rules)
  if shards <= 1:
    return
  if not task.context_parallel:
    fail('mesh.axes', f'the rules split sequences over {shards} devices (context '
         f'parallelism), which trains language models and seq2seq models; this run\'s task '
         f'is {task.name}: leave the context axis out of mesh.axes or give it size 1')
  need = 2 * shards if task.balanced else shards
  for name, value in sorted(example.items()):
    if np.ndim(value) >= 2 and np.issubdtype(np.asarray(value).dtype, np.integer) and (
        np.shape(value)[-1] % need):
      fail('data.seq_len', f'the batch field {name!r} has {np.shape(value)[-1]} positions, '
           f'which do not split into {need} equal blocks for the {shards} devices the sequence '
           f'is split over (context parallelism{", load-balanced" if task.balanced else ""}); '
           f'use a multiple of {need}')


def validate_shardings(param_rows: list, mesh: jax.sharding.Mesh, rules: tuple) -> None:
  """Every parameter axis has a rule, and each sharded dimension divides over its mesh axes."""
  ruled = {name for name, _ in rules}
  for row in param_rows:
    for name in row['logical_axes']:
      if name is not None and name not in ruled:
        fail('logical_axis_rules', f'parameter {row["path"]} uses logical axis {name!r} that no '
             f'rule maps; add ({name!r}, None) or ({name!r}, <mesh axis>)')
    for dim, entry, shard in zip(row['shape'], row['partition_spec'], row['shard_shape']):
      if shard is None:
        axes = sharding.mesh_axes_of(entry)
        shards = math.prod(mesh.shape[a] for a in axes)
        fail('logical_axis_rules', f'parameter {row["path"]} of shape {tuple(row["shape"])} '
             f'has a dimension of {dim} split over {shards} devices {axes}; '
             'change the model size, the mesh shape or the rule')
