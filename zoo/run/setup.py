"""One path from a config to placement: the Setup that trainer, plan, sampler, benchmarks and
tests all build.

A Setup is what a run knows before any array exists: the dataset, the model family and
its task, the mesh and the logical-axis rules, the model and optimizer, the train state's
shapes with their logical axis names, and the shardings of the state and of a batch.
Everything that traces model code does so inside `setup.scope()` (mesh + rules), without
which a logical constraint silently does nothing.
"""
import collections
import contextlib
import dataclasses
import functools
import json
import math
import types
from typing import Any, Callable, Optional

from absl import logging
import flax.linen as nn
import jax
import ml_collections
import numpy as np
import optax

from zoo import data, models
from zoo.models import attention, lora, quantize, transformer
from zoo.data import choice, feed
from zoo.data.dataset import Dataset
from zoo.errors import ConfigError
from zoo.models.family import ModelFamily
from zoo.parallel import mesh as mesh_lib
from zoo.parallel import context, sharding
from zoo.run import config as cfg
from zoo.run import memory, optim, steps, tasks


@dataclasses.dataclass(frozen=True)
class Setup:
  """A config placed on a mesh: everything but the arrays."""
  config: ml_collections.ConfigDict
  dataset: Dataset
  family: ModelFamily
  task: tasks.Task
  mesh: jax.sharding.Mesh
  rules: tuple                  # ((logical name, mesh axis or None), ...), Flax's convention.
  model: nn.Module
  optimizer: optax.GradientTransformation
  lr_schedule: optax.Schedule
  batch_sharding: jax.sharding.NamedSharding  # A batch's rows: over the batch axes.
  init_state: Callable[[jax.Array], steps.TrainState]   # rng -> state with logical boxes.
  logical_state: steps.TrainState    # Its shapes; leaves nn.Partitioned with logical names.
  state_shardings: steps.TrainState  # A NamedSharding per leaf of the state.
  rng: jax.Array                # The run's key, for initialisation (dropout: steps.dropout_key).
  batch: dict                   # A global train batch's shapes and sharding (ShapeDtypeStructs).
  # A local batch as the devices take it: in context parallelism's load-balanced order
  # where the task's batches can be (zoo.parallel.context), else as it is.
  arrange: Callable[[dict], dict] = feed.as_is
  # Where each field of such a batch lies: its rows, and in that order, its sequence slices.
  placement: feed.Placement = None
  choice_tasks: tuple = ()      # Multiple-choice tasks evaluated in the loop (zoo.data.choice).
  trainable: steps.Trainable = None  # LoRA: only the adapters train (zoo.models.lora).
  # The jitted programs of this build (see `jit`), shared by every Setup that `build`
  # makes of the same config, data shapes, mesh and rules in this process.
  programs: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

  def scope(self) -> contextlib.AbstractContextManager:
    """The mesh and the rules, under which model code is traced (and constraints kept)."""
    return sharding.scope(self.mesh, self.rules)

  def abstract_state(self) -> steps.TrainState:
    """The state's ShapeDtypeStructs carrying their shardings: what a plan compiles for and
    a restore reads into. (The logical state's shapes, unboxed: the model is not traced again.)"""
    shapes = jax.tree.map(lambda x: x.value if isinstance(x, nn.Partitioned) else x,
                          self.logical_state, is_leaf=lambda x: isinstance(x, nn.Partitioned))
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        shapes, self.state_shardings)

  def eval_batch(self) -> dict:
    """A global eval batch's shapes and sharding (ShapeDtypeStructs), from one row."""
    size = self.config.eval.batch_size
    example = next(iter(self.dataset.eval_batches(size, slice(0, 1))))
    example = self.arrange({**self.task.train_example(example), 'weights': example['weights']})
    return _global(example, size, self.placement)

  def jit(self, fn: Callable, *args: Any, **kwargs: Any) -> Callable:
    """jax.jit(functools.partial(fn, *args, **kwargs), **jit_kwargs), where the keyword
    arguments that are jax.jit's (_JIT_KEYWORDS: shardings, donated and static arguments):
    built once per build and kept in `programs`, so that a second run of the same build in
    this process (a resume, a notebook's next call) finds JAX's own caches of it and traces,
    lowers and compiles nothing again. The key is `fn` and each argument, by value where it
    is a number, string or sharding, else by identity (kept alive with the program)."""
    jit_kwargs = {k: kwargs.pop(k) for k in _JIT_KEYWORDS if k in kwargs}
    if attention.is_recording():  # Its record is written as the program traces (a plan).
      return jax.jit(functools.partial(fn, *args, **kwargs), **jit_kwargs)
    parts = (fn, *args, *sorted(kwargs.items()), *sorted(jit_kwargs.items()))
    key = tuple(_key_of(p) for p in parts)
    if key not in self.programs:
      self.programs[key] = (jax.jit(functools.partial(fn, *args, **kwargs), **jit_kwargs), parts)
    return self.programs[key][0]

  def create_state(self) -> steps.TrainState:
    """A fresh state initialised directly into its shards: never materialised replicated."""
    return self.jit(_unboxed, self.init_state, out_shardings=self.state_shardings)(self.rng)

  def jit_train_step(self) -> Callable[[steps.TrainState, dict], tuple[steps.TrainState, dict]]:
    """(state, batch) -> (state, metrics), jitted with the shardings; the state is donated
    and the seed of dropout's keys bound in."""
    return self.jit(steps.train_step, seed=self.config.seed, task=self.task,
                    microbatches=self.config.train.microbatches, trainable=self.trainable,
                    lr_schedule=self.lr_schedule,
                    in_shardings=(self.state_shardings, self.placement.shardings(self.batch)),
                    out_shardings=(self.state_shardings, None), donate_argnums=0)

  def jit_eval_step(self) -> Callable[[steps.TrainState, dict], dict]:
    batch = self.eval_batch() if self.placement.cells is not None else {}
    return self.jit(steps.eval_step, task=self.task,
                    in_shardings=(self.state_shardings, self.placement.shardings(batch)))

  def jit_score_step(self) -> Callable[[Any, dict], dict]:
    """(params, batch) -> each row's log-likelihood of its masked targets and whether they
    are all the likeliest tokens (steps.score_step), on every process."""
    replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
    return self.jit(steps.score_step, apply_fn=self.model.apply, task=self.task,
                    in_shardings=(self.state_shardings.params, self.batch_sharding),
                    out_shardings=replicated)

  def jit_check_state(self) -> Callable[[steps.TrainState], dict]:
    # steps.check_state is looked up when this is called, so tests can replace it.
    return self.jit(steps.check_state, in_shardings=(self.state_shardings,))

  def param_table(self) -> list[dict]:
    """One row per parameter and BatchNorm statistic: path, shape, dtype, logical axes,
    PartitionSpec, shard shape (see sharding.param_table)."""
    return (sharding.param_table(self.logical_state.params, self.mesh, self.rules)
            + sharding.param_table(self.logical_state.model_state, self.mesh, self.rules))


def build(config: ml_collections.ConfigDict, dataset: Dataset,
          mesh: Optional[jax.sharding.Mesh] = None, rules: Optional[Any] = None,
          devices: Optional[list] = None) -> Setup:
  """The Setup of `config` on its mesh over `devices` (default: all; or on `mesh`, under
  `rules`); checks nothing. Built again for the same config, data shapes and model fields,
  mesh and rules in this process, it shares the first's model, optimizer and programs."""
  rules = sharding.for_mesh(config.logical_axis_rules if rules is None else rules,
                            config.mesh.axes if mesh is None else mesh.axis_names)
  if mesh is None:
    mesh = mesh_lib.make_mesh(config.mesh.shape, config.mesh.axes, devices,
                              dcn_shape=config.mesh.dcn_shape,
                              batch_axes=sharding.batch_mesh_axes(rules))
  family = models.MODELS[config.model.name]
  example = dataset.train_batch(0, 1, slice(0, 1))  # One row: the shapes.
  key = (config.to_json_best_effort(sort_keys=True), id(family), dataset.task,
         json.dumps(dataset.model_fields, sort_keys=True, default=repr),
         tuple((k, v.shape, str(v.dtype)) for k, v in sorted(example.items())), mesh, rules)
  if key in _BUILT:  # The same programs: see Setup.jit.
    _BUILT.move_to_end(key)
    built = _BUILT[key]
  else:
    built = _build(config, dataset, family, example, mesh, rules)
    _BUILT[key] = built
    while len(_BUILT) > _BUILDS_KEPT:
      _BUILT.popitem(last=False)
  return Setup(config=config, dataset=dataset, family=family, mesh=mesh, rules=rules, **built)


# What `build` made for a (config, data shapes, mesh, rules) in this process, newest last:
# building the same again reuses its model, optimizer and programs (Setup.jit). A few are
# kept: a run and its resume, a test's runs on one mesh.
_BUILT = collections.OrderedDict()
_BUILDS_KEPT = 8
_JIT_KEYWORDS = ('in_shardings', 'out_shardings', 'donate_argnums', 'static_argnums')


def _build(config: ml_collections.ConfigDict, dataset: Dataset, family: ModelFamily,
           example: dict, mesh: jax.sharding.Mesh, rules: tuple) -> dict:
  """A Setup's fields that depend on the data only through its shapes and model fields
  (all of them but the config, the dataset, the family, the mesh and the rules)."""
  task = tasks.make(dataset.task if tasks.model_task(dataset.task) == family.task
                    else family.task, config)
  model = models.build(config.model, **dataset.model_fields)
  optimizer, lr_schedule = optim.make_optimizer(config.train.steps, **config.optimizer)
  batch_sharding = jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec(sharding.batch_mesh_axes(rules) or None))
  shards = sharding.sequence_shards(mesh, rules)
  placement = feed.Placement(batch_sharding)
  arrange = feed.as_is
  if task.balanced and shards > 1:  # Fed load-balanced, each process its sequence slice.
    arrange = functools.partial(context.balance, shards=shards)
    placement = feed.Placement(batch_sharding, jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(batch_sharding.spec[0],
                                         sharding.sequence_mesh_axes(rules))),
        example['inputs'].shape[1])
  example = arrange(task.train_example(example))
  batch = _global(example, config.train.batch_size, placement)
  # Zeros on the host: the state's shapes need no device work.
  trainable = lora.is_adapter if getattr(model, 'lora', lora.Lora()).rank else None
  init_state = steps.state_initializer(model, optimizer, task, jax.tree.map(np.zeros_like, example),
                                       trainable)
  rng = jax.random.key(config.seed)  # Outside the mesh: made on this host's device.
  with sharding.scope(mesh, rules):
    logical_state = jax.eval_shape(init_state, rng)
  return dict(task=task, model=model, optimizer=optimizer, lr_schedule=lr_schedule,
              batch_sharding=batch_sharding, init_state=init_state, logical_state=logical_state,
              state_shardings=sharding.logical_shardings(logical_state, mesh, rules),
              rng=rng, batch=batch, arrange=arrange, placement=placement, trainable=trainable,
              programs={})


def _global(example: dict, size: int, placement: feed.Placement) -> dict:
  """A global batch's ShapeDtypeStructs, placed, from one row of each field."""
  return {k: jax.ShapeDtypeStruct((size,) + v.shape[1:], v.dtype,
                                  sharding=placement.of((size,) + v.shape[1:]))
          for k, v in example.items()}


def _unboxed(init_state: Callable, rng: jax.Array) -> steps.TrainState:
  return nn.meta.unbox(init_state(rng))


def _key_of(part: Any) -> Any:
  """`part` in a program's key (Setup.jit): by value where that is what it means, else by
  identity."""
  if part is None or isinstance(part, (bool, int, float, str)):
    return type(part), part  # 1, 1.0 and True are equal, but not the same argument.
  if isinstance(part, jax.sharding.Sharding):
    return part
  if isinstance(part, tuple):
    return tuple(_key_of(p) for p in part)
  if isinstance(part, dict):  # A batch's shardings (feed.Placement.shardings).
    return ('dict', tuple((k, _key_of(v)) for k, v in sorted(part.items())))
  if isinstance(part, types.MethodType):  # A bound method: a new object at each lookup.
    return ('method', part.__func__, id(part.__self__))
  return ('id', id(part))


def placed(config: ml_collections.ConfigDict, dataset: Dataset, mesh_shape: str = '',
           rows: Optional[int] = None, doing: str = 'running') -> Setup:
  """The Setup of a run whose sizes were chosen elsewhere (a sample, an import or export)
  on this machine's devices: on `mesh_shape` (--mesh_shape, e.g. '2,4'), by default every
  device on 'model'. What the parameters cannot split over that mesh is replicated
  (logged); on the default mesh, if more than grouped-query key/value heads would be, the
  run goes on one device instead (`doing` names it in the warning). `rows`: a batch's
  rows, replicated where they do not divide over the batch shards."""
  axes, devices = tuple(config.mesh.axes), jax.devices()
  check_quantization(config, devices[0])
  one = mesh_lib.make_mesh([1] * len(axes), axes, devices[:1])
  logical = build(config, dataset, mesh=one).logical_state.params  # The parameters' names.
  wanted = sharding.for_mesh(config.logical_axis_rules, axes)
  if mesh_shape:
    mesh = mesh_lib.make_mesh(mesh_lib.parse_mesh_shape(mesh_shape, axes, len(devices)), axes,
                              devices)
  else:
    mesh = mesh_lib.make_mesh([len(devices) if a == 'model' else 1 for a in axes], axes, devices)
  rules = sharding.fit_rules(logical, mesh, wanted)
  replicated = [name for (name, a), (_, b) in zip(wanted, rules) if a != b]
  if not mesh_shape and not set(replicated) <= {'kv_heads', 'act_kv_heads'}:
    logging.warning('the parameters do not split over %d devices on the model axis; %s on '
                    'one device (set --mesh_shape to choose)', len(devices), doing)
    mesh, rules, replicated = one, wanted, []
  if replicated:
    logging.info('replicating %s: the parameters do not split over mesh %s', replicated,
                 dict(mesh.shape))
  if rows is not None and rows % sharding.batch_shards(mesh, rules):
    rules = tuple((name, None if name == 'act_batch' else axis) for name, axis in rules)
  return build(config, dataset, mesh=mesh, rules=rules)


def checked(config: ml_collections.ConfigDict, devices: Optional[list] = None,
            plan: bool = False) -> Setup:
  """The Setup of a config that config.validate passed, on `devices` (default: all), once
  its data (for a `plan`, but its size), its parameters' shardings and every process's
  batch rows are checked too (ConfigError if they do not fit), and that the devices run
  the model's low-precision matmuls. Writes nothing."""
  check_quantization(config, (devices or jax.devices())[0])
  dataset = data.load(config.data, config.seed, plan=True) if plan else data.load(config.data,
                                                                                 config.seed)
  cfg.validate_with_data(config, dataset, plan)
  shape = mesh_lib.resolve_mesh_shape(config.mesh.shape, len(devices or jax.devices()))
  cfg.validate_sequence_split(tasks.make(dataset.task, config),
                              dataset.train_batch(0, 1, slice(0, 1)),
                              jax.sharding.AbstractMesh(shape, tuple(config.mesh.axes)),
                              sharding.for_mesh(config.logical_axis_rules, config.mesh.axes))
  setup = build(config, dataset, devices=devices)
  with setup.scope():
    cfg.validate_shardings(setup.param_table(), setup.mesh, setup.rules)
  if config.model.get('quantization', 'none') != 'none' and not any(quantized(setup)):
    raise ConfigError(f'config.model.quantize_modules: {tuple(config.model.quantize_modules)} '
                      "match none of the model's projection kernels, whose parameter paths "
                      "are matched in full (e.g. 'blocks/attn/query', 'block_0/mlp/wo'; '.*': "
                      "all); fix the expressions, or set model.quantization='none'")
  for size in (config.train.batch_size, config.eval.batch_size):
    feed.rows_by_process(setup.batch_sharding, size)  # One block each, or ConfigError.
  if not plan:
    check_memory(setup)
    setup = dataclasses.replace(setup, choice_tasks=tuple(
        choice.load(spec, dataset.encode, config.data.seq_len, dataset.eos_id)
        for spec in config.eval.get('choice_tasks', ())))
  return setup


def check_quantization(config: ml_collections.ConfigDict, device: jax.Device) -> None:
  """ConfigError if `device` cannot run config.model.quantization's matmuls: every command
  that builds a model (training, plans, sampling, evaluation, imports) runs it."""
  kind = config.model.get('quantization', 'none')
  if why := quantize.refusal(kind, device):
    raise ConfigError(f'config.model.quantization: {kind!r}: {why}')


def quantized(setup: Setup) -> tuple[list, list]:
  """(the parameter paths whose matmuls the model runs in low precision, those its rules
  match that stay in the computation dtype) (zoo.models.transformer.quantized); nothing for
  model.quantization='none' and models without it."""
  if getattr(setup.model, 'quantization', 'none') == 'none':
    return [], []
  with setup.scope():
    return transformer.quantized(setup.model, [row['path'] for row in setup.param_table()])


def _path_name(path: tuple) -> str:
  return '/'.join(str(getattr(k, 'key', getattr(k, 'name', k))) for k in path)


def _gib(n: float) -> str:
  return f'{n / 2**30:.1f} GiB'


def _field_of(config: ml_collections.ConfigDict, shape: tuple) -> str:
  """The model or data field whose value is the largest dimension of `shape` (what made a
  parameter huge), or 'model' if none is."""
  for dim in sorted((d for d in shape if d > 1), reverse=True):
    for group in ('model', 'data'):
      for key, value in config[group].items():
        values = value if isinstance(value, (tuple, list)) else (value,)
        if any(isinstance(v, int) and not isinstance(v, bool) and v == dim for v in values):
          return f'{group}.{key}'
  return 'model'


def check_memory(setup: Setup) -> None:
  """A quick bound before anything is allocated: the train state's shards on a device and
  the host's batches must each fit in the memory there is (a device's limit; on CPU the
  host's, which its devices share). ConfigError naming the field that makes them too big:
  a typo like model.max_len=1e9 would otherwise allocate for minutes. Not a plan (the
  step's temporaries are not counted): `--dry_run` compiles the step and checks those."""
  config, state = setup.config, setup.abstract_state()
  shard = lambda x: math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
  leaves = jax.tree_util.tree_leaves_with_path(state)
  per_device = sum(shard(x) for _, x in leaves)
  largest_path, largest = max(leaves, key=lambda kv: shard(kv[1]))
  limit, where = memory.limit_per_device()
  if limit is not None and per_device > limit:
    field = _field_of(config, largest.shape)
    raise ConfigError(
        f'config.{field}: the train state needs {_gib(per_device)} per device (largest: '
        f'{_path_name(largest_path)} {tuple(largest.shape)} {largest.dtype}), more '
        f'than the {_gib(limit)} {where}; lower {field}, or shard more (mesh.shape, '
        'fsdp rules). --dry_run plans a run without running it')
  host = memory.host_bytes_available()
  if host is None:
    return
  row_bytes = sum(math.prod(x.shape[1:]) * x.dtype.itemsize for x in setup.batch.values())
  for field, size, copies in (('train.batch_size', config.train.batch_size,
                               config.data.prefetch + 1),
                              ('eval.batch_size', config.eval.batch_size, 1)):
    rows = feed.rows_by_process(setup.batch_sharding, size)[jax.process_index()]
    one = (rows.stop - rows.start) * row_bytes
    if one * copies > host:
      if one <= host // 2:  # One batch fits: too many are prefetched.
        field = 'data.prefetch'
      raise ConfigError(f'config.{field}: {size} rows need {_gib(one * copies)} of host memory on '
                        f'this process ({rows.stop - rows.start} rows of {row_bytes} B'
                        + (f', {copies} batches in flight' if copies > 1 else '')
                        + f'), more than the {_gib(host)} it has free; lower {field}')
