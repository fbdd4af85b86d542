"""The config every experiment starts from, and its validation before anything compiles.

Public keys (a stable contract, see README): model.name and the model's fields,
data.name, mesh.axes, mesh.shape, logical_axis_rules, train.steps, train.batch_size,
seed, optimizer.*, eval.every_steps.
"""
import math
import os

import flax.linen as nn
import ml_collections

from zoo import data, models, optim, sharding
from zoo.models import transformer
from zoo.errors import ConfigError


def base_config():
  """Defaults shared by all experiments; an experiment sets model, data and sizes."""
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.model = ml_collections.ConfigDict()   # name + the model's constructor fields.
  c.data = ml_collections.ConfigDict()    # name + the loader's options.
  c.data.name = 'digits'
  c.data.path = ''                        # text: a UTF-8 file (empty: bundled); npz: required.
  c.data.prefetch = 2                     # Train batches built and put on devices ahead (0: none).
  c.mesh = ml_collections.ConfigDict()
  c.mesh.axes = sharding.MESH_AXES
  c.mesh.shape = (-1, 1)                  # One entry may be -1: filled from the device count.
  c.mesh.dcn_shape = (1, 1)               # Multi-slice TPU: slices along each axis (put them on 'batch').
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
  c.eval.sample_temperature = 0.8         # LM only: the sample printed at each eval; 0 is greedy.
  c.profile = ml_collections.ConfigDict()
  c.profile.steps = ()                    # (a, b): trace steps [a, b) into workdir/profile.
  c.perf = ml_collections.ConfigDict()
  c.perf.peak_flops_per_device = 0.0      # For MFU; 0: the device's data sheet (CPU: measured).
  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every_steps = 1000         # Also saved after the last step and on SIGTERM.
  c.checkpoint.keep = 3                   # Newest complete checkpoints kept in workdir/checkpoints.
  c.checkpoint.async_save = True          # Write in the background while training goes on.
  c.checkpoint.init_from = ''             # A run's workdir or checkpoints/ dir: start from its params.
  c.checkpoint.fallback = False           # If the newest checkpoint is damaged, resume from an older one.
  # False: each shard is written once, by its first replica (fastest on one host: the loop
  # is blocked ~4x less on CPU). True: replicas split the write, which pays off only when
  # many hosts hold copies of large replicated arrays.
  c.checkpoint.replica_parallel = False
  return c


def load_experiment(path, arg=None):
  """`get_config(arg)` of an experiment file (what --config=PATH:ARG loads), for scripts."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def _fail(field, message):
  raise ConfigError(f'config.{field}: {message}')


def validate(config, num_devices):
  """Raises ConfigError on the first bad field; needs only the config and device count."""
  if config.model.get('name') not in models.MODELS:
    _fail('model.name', f'unknown model {config.model.get("name")!r}; known: {", ".join(models.MODELS)}')
  if config.data.get('name') not in data.DATASETS:
    _fail('data.name', f'unknown dataset {config.data.get("name")!r}; known: {", ".join(data.DATASETS)}')
  _validate_mesh(config.mesh, num_devices)
  _validate_rules(config.logical_axis_rules, config.mesh.axes)
  _, task = models.MODELS[config.model.name]
  data_task = data.DATASETS[config.data.name]
  if data_task is not None and task != data_task:
    _fail('data.name', f'model {config.model.name!r} trains on {task} data but '
          f'{config.data.name!r} is {data_task} data; pick a matching model or dataset')
  _validate_sizes(config)
  if config.model.name == 'resnet' and len(config.model.stage_sizes) != len(config.model.features):
    _fail('model.features', f'{tuple(config.model.features)} must give one channel count per stage '
          f'of model.stage_sizes={tuple(config.model.stage_sizes)}')
  if 'num_heads' in config.model:
    _validate_transformer(config)
  for field in ('train.steps', 'train.batch_size', 'train.log_every_steps',
                'eval.every_steps', 'eval.batch_size', 'checkpoint.every_steps', 'checkpoint.keep'):
    group, key = field.split('.')
    if config[group][key] <= 0:
      _fail(field, f'must be positive, got {config[group][key]}')
  if not config.optimizer.learning_rate > 0:
    _fail('optimizer.learning_rate', f'must be positive, got {config.optimizer.learning_rate}')
  if config.optimizer.name not in optim.OPTIMIZERS:
    _fail('optimizer.name', f'unknown optimizer {config.optimizer.name!r}; known: {", ".join(optim.OPTIMIZERS)}')
  if config.optimizer.schedule not in optim.SCHEDULES:
    _fail('optimizer.schedule', f'unknown schedule {config.optimizer.schedule!r}; '
          f'known: {", ".join(optim.SCHEDULES)}')
  shape = sharding.resolve_mesh_shape(config.mesh.shape, num_devices)
  batch_shards = math.prod(shape[config.mesh.axes.index(a)] for a in batch_mesh_axes(config))
  for field in ('train.batch_size', 'eval.batch_size'):
    group, key = field.split('.')
    if config[group][key] % batch_shards:
      _fail(field, f'{config[group][key]} is not divisible by the {batch_shards} shards of the '
            f'batch (mesh axes {batch_mesh_axes(config)}); use a multiple of {batch_shards}')
  k = config.train.microbatches
  if k <= 0 or config.train.batch_size % (k * batch_shards):
    _fail('train.microbatches', f'{k}: train.batch_size={config.train.batch_size} must split into '
          f'{k} microbatches that each divide over the {batch_shards} batch shards; use a '
          f'positive divisor of {config.train.batch_size // batch_shards}')


def _validate_transformer(config):
  """The Transformer families' switches (see zoo.models.transformer) and lengths."""
  m = config.model
  if m.d_model % m.num_heads:
    _fail('model.num_heads', f'{m.num_heads} does not divide model.d_model={m.d_model}')
  choices = {'remat': tuple(transformer.REMAT_POLICIES), 'dtype': transformer.DTYPES,
             'positions': transformer.POSITIONS}
  for key, known in choices.items():
    if key in m and m[key] not in known:
      _fail(f'model.{key}', f'unknown {key} {m[key]!r}; known: {", ".join(known)}')
  if m.get('positions') == 'rotary' and (m.d_model // m.num_heads) % 2:
    _fail('model.positions', f'rotary positions need an even head size, got '
          f'd_model/num_heads = {m.d_model // m.num_heads}')
  if m.name == 'vit' and m.get('pool', 'cls') not in ('cls', 'mean'):
    _fail('model.pool', f"unknown pool {m.pool!r}; known: cls, mean")
  if not 0 <= m.get('dropout_rate', 0.0) < 1:
    _fail('model.dropout_rate', f'must be in [0, 1), got {m.dropout_rate}')
  lengths = {'text': config.data.get('seq_len'), 'npz': config.data.get('seq_len'),
             'seq': (2 * config.data.get('digits', 0) + 1 if config.data.get('problem') == 'add'
                     else config.data.get('digits', 0))}
  needed = lengths.get(config.data.name)
  if 'max_len' in m and needed and m.max_len < needed:
    _fail('model.max_len', f'{m.max_len} is shorter than the {needed} positions of the data')


def batch_mesh_axes(config):
  """The mesh axes that the rules map 'act_batch' onto (Flax's first matching rule)."""
  rules = [tuple(r) for r in config.logical_axis_rules]
  return sharding.mesh_axes_of(nn.logical_to_mesh_axes(('act_batch',), rules)[0])


def _validate_sizes(config):
  """Model sizes, sequence length, seed and counts that must be positive (or >= 0)."""
  for key, value in config.model.items():
    values = value if isinstance(value, (tuple, list)) else (value,)
    if any(isinstance(v, int) and not isinstance(v, bool) and v <= 0 for v in values):
      _fail(f'model.{key}', f'sizes must be positive, got {value}')
  if 'seq_len' in config.data and config.data.seq_len <= 0:
    _fail('data.seq_len', f'must be positive, got {config.data.seq_len}')
  if config.data.name == 'text' and config.data.path and not os.path.isfile(config.data.path):
    _fail('data.path', f'{config.data.path} is not a file; give a UTF-8 text file, or leave it '
          'empty for the text bundled with Python')
  if config.data.name == 'npz' and not os.path.isfile(config.data.path):
    _fail('data.path', f'{config.data.path!r} is not a file; give a .npz file with x_train, y_train, '
          'x_test, y_test (classification) or train_tokens, test_tokens (language)')
  if config.data.name == 'seq':
    from zoo.data import seq  # pylint: disable=import-outside-toplevel
    if config.data.get('problem') not in seq.PROBLEMS:
      _fail('data.problem', f'unknown problem {config.data.get("problem")!r}; known: {", ".join(seq.PROBLEMS)}')
    if not 1 <= config.data.get('digits', 0) <= 18:
      _fail('data.digits', f'must be in 1..18 (int64 sums), got {config.data.get("digits")}')
    if config.data.get('num_eval', 0) <= 0:
      _fail('data.num_eval', f'must be positive, got {config.data.get("num_eval")}')
  steps = tuple(config.profile.steps)
  if steps and not (len(steps) == 2 and 0 <= steps[0] < steps[1] <= config.train.steps):
    _fail('profile.steps', f'{steps} must be () or (a, b) with 0 <= a < b <= train.steps='
          f'{config.train.steps}')
  if config.seed < 0:
    _fail('seed', f'must be >= 0, got {config.seed}')
  if config.data.prefetch < 0:
    _fail('data.prefetch', f'must be >= 0 (0: no prefetching), got {config.data.prefetch}')
  if config.perf.peak_flops_per_device < 0:
    _fail('perf.peak_flops_per_device', f'must be >= 0 (0: look it up or measure it), got '
          f'{config.perf.peak_flops_per_device}')
  if config.eval.max_batches < 0:
    _fail('eval.max_batches', f'must be >= 0 (0: the whole eval split), got {config.eval.max_batches}')


def _validate_mesh(mesh, num_devices):
  shape, axes = tuple(mesh.shape), tuple(mesh.axes)
  if len(shape) != len(axes):
    _fail('mesh.shape', f'{shape} has {len(shape)} entries but mesh.axes {axes} has {len(axes)}; '
          'give one size per axis (repeating --config.mesh.shape concatenates the tuples)')
  if 'batch' not in axes or len(set(axes)) != len(axes):
    _fail('mesh.axes', f'{axes} must name distinct axes including "batch"')
  if shape.count(-1) > 1:
    _fail('mesh.shape', f'{shape} has more than one -1; at most one axis size can be inferred')
  if any(s == 0 or s < -1 for s in shape):
    _fail('mesh.shape', f'{shape} has a size that is neither positive nor -1')
  dcn = tuple(mesh.dcn_shape)
  if len(dcn) != len(axes) or any(d <= 0 for d in dcn):
    _fail('mesh.dcn_shape', f'{dcn} must give one positive number of slices per axis of {axes}')
  known = math.prod(s for s in shape if s != -1)
  if -1 in shape and num_devices % known:
    _fail('mesh.shape', f'{shape}: {num_devices} devices do not divide by {known}; '
          f'make the other sizes divide {num_devices}')
  if -1 not in shape and known != num_devices:
    _fail('mesh.shape', f'{shape} needs {known} devices but {num_devices} are present; '
          f'make the product {num_devices} or put -1 for one axis')
  resolved = sharding.resolve_mesh_shape(shape, num_devices)
  if any(s % d for s, d in zip(resolved, dcn)):
    _fail('mesh.dcn_shape', f'{dcn} does not divide the mesh shape {resolved}; each axis size '
          'must be a multiple of its number of slices')


def _validate_rules(rules, mesh_axes):
  for rule in rules:
    if len(rule) != 2:
      _fail('logical_axis_rules', f'{tuple(rule)} is not a (logical name, mesh axis or None) pair')
    name, axis = rule
    if name not in sharding.LOGICAL_AXES:
      _fail('logical_axis_rules', f'unknown logical axis {name!r}; known: {", ".join(sharding.LOGICAL_AXES)}')
    for a in sharding.mesh_axes_of(axis):
      if a not in mesh_axes:
        _fail('logical_axis_rules', f'rule ({name!r}, {axis!r}) names mesh axis {a!r}, '
              f'but the mesh axes are {tuple(mesh_axes)}')


def validate_with_data(config, dataset):
  _, task = models.MODELS[config.model.name]
  if dataset.task != task:
    _fail('data.path', f'{config.data.path} holds {dataset.task} data but model '
          f'{config.model.name!r} trains on {task} data; pick a matching model or file')
  if config.model.name == 'vit':
    image = dataset.train_batch(0, 1, slice(0, 1))['inputs'].shape[1:3]
    if any(size % config.model.patch_size for size in image):
      _fail('model.patch_size', f'{config.model.patch_size} does not divide the {image[0]}x{image[1]} '
            'images; pick a divisor of both sides')
  if config.train.batch_size > dataset.num_train:
    _fail('train.batch_size', f'{config.train.batch_size} exceeds the {dataset.num_train} '
          f'training examples of {config.data.name!r}')


def validate_shardings(param_rows, mesh, rules):
  """Every parameter axis has a rule, and each sharded dimension divides over its mesh axes."""
  ruled = {name for name, _ in rules}
  for row in param_rows:
    for name in row['logical_axes']:
      if name is not None and name not in ruled:
        _fail('logical_axis_rules', f'parameter {row["path"]} uses logical axis {name!r} that no rule '
              f'maps; add ({name!r}, None) or ({name!r}, <mesh axis>)')
    for dim, entry, shard in zip(row['shape'], row['partition_spec'], row['shard_shape']):
      if shard is None:
        axes = sharding.mesh_axes_of(entry)
        shards = math.prod(mesh.shape[a] for a in axes)
        _fail('logical_axis_rules', f'parameter {row["path"]} of shape {tuple(row["shape"])} '
              f'has a dimension of {dim} split over {shards} devices {axes}; '
              'change the model size, the mesh shape or the rule')


def check_workdir(workdir):
  """Fails if `workdir` cannot be created or written, without creating anything."""
  if '://' in workdir:
    raise ConfigError(f'--workdir: {workdir}: remote URLs are not supported yet; use a directory '
                      'that every host mounts (NFS, or a bucket through gcsfuse)')
  path = os.path.abspath(workdir)
  if os.path.exists(path) and not os.path.isdir(path):
    raise ConfigError(f'--workdir: {workdir} exists and is not a directory; pick another path')
  existing = path
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
    raise ConfigError(f'--workdir: {workdir} cannot be written ({existing} is not a writable '
                      'directory); pick a writable path')
