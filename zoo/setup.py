"""One path from a config to placement: the Setup that trainer, plan, sampler, benchmarks and
tests all build.

A Setup is what a run knows before any array exists: the dataset, the model family and
its task, the mesh and the logical-axis rules, the model and optimizer, the train state's
shapes with their logical axis names, and the shardings of the state and of a batch.
Everything that traces model code does so inside `setup.scope()` (mesh + rules), without
which a logical constraint silently does nothing.
"""
import contextlib
import dataclasses
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import ml_collections
import numpy as np
import optax

from zoo import config as cfg
from zoo import data, models, optim, sharding, steps, tasks
from zoo import mesh as mesh_lib
from zoo.data import feed
from zoo.data.dataset import Dataset
from zoo.models.family import ModelFamily


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
  batch_sharding: jax.sharding.NamedSharding
  init_state: Callable[[jax.Array], steps.TrainState]   # rng -> state with logical boxes.
  logical_state: steps.TrainState    # Its shapes; leaves nn.Partitioned with logical names.
  state_shardings: steps.TrainState  # A NamedSharding per leaf of the state.
  rng: jax.Array                # The run's key, for initialisation (dropout: steps.dropout_key).
  batch: dict                   # A global train batch's shapes and sharding (ShapeDtypeStructs).

  def scope(self) -> contextlib.AbstractContextManager:
    """The mesh and the rules, under which model code is traced (and constraints kept)."""
    return sharding.scope(self.mesh, self.rules)

  def abstract_state(self) -> steps.TrainState:
    """The state's ShapeDtypeStructs carrying their shardings: what a plan compiles for and
    a restore reads into."""
    shapes = jax.eval_shape(lambda rng: nn.meta.unbox(self.init_state(rng)), self.rng)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        shapes, self.state_shardings)

  def eval_batch(self) -> dict:
    """A global eval batch's shapes and sharding (ShapeDtypeStructs), from one row."""
    size = self.config.eval.batch_size
    example = next(iter(self.dataset.eval_batches(size, slice(0, 1))))
    return {k: jax.ShapeDtypeStruct((size,) + v.shape[1:], v.dtype, sharding=self.batch_sharding)
            for k, v in example.items()}

  def create_state(self) -> steps.TrainState:
    """A fresh state initialised directly into its shards: never materialised replicated."""
    return jax.jit(lambda rng: nn.meta.unbox(self.init_state(rng)),
                   out_shardings=self.state_shardings)(self.rng)

  def param_table(self) -> list[dict]:
    """One row per parameter and BatchNorm statistic: path, shape, dtype, logical axes,
    PartitionSpec, shard shape (see sharding.param_table)."""
    return (sharding.param_table(self.logical_state.params, self.mesh, self.rules)
            + sharding.param_table(self.logical_state.model_state, self.mesh, self.rules))


def build(config: ml_collections.ConfigDict, dataset: Dataset,
          mesh: Optional[jax.sharding.Mesh] = None, rules: Optional[Any] = None,
          devices: Optional[list] = None) -> Setup:
  """The Setup of `config` on its mesh over `devices` (default: all; or on `mesh`, under
  `rules`); checks nothing."""
  if mesh is None:
    mesh = mesh_lib.make_mesh(config.mesh.shape, config.mesh.axes, devices,
                              dcn_shape=config.mesh.dcn_shape)
  rules = sharding.rules_tuple(config.logical_axis_rules if rules is None else rules)
  family = models.MODELS[config.model.name]
  task = tasks.TASKS[family.task]
  model = models.build(config.model, **dataset.model_fields)
  optimizer, lr_schedule = optim.make_optimizer(config.train.steps, **config.optimizer)
  batch_sharding = jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec(sharding.batch_mesh_axes(rules) or None))
  size = config.train.batch_size
  example = dataset.train_batch(0, 1, slice(0, 1))  # One example: the shapes.
  batch = {k: jax.ShapeDtypeStruct((size,) + v.shape[1:], v.dtype, sharding=batch_sharding)
           for k, v in example.items()}
  # Zeros on the host: the state's shapes need no device work.
  init_state = steps.state_initializer(model, optimizer, task, jax.tree.map(np.zeros_like, example))
  rng = jax.random.key(config.seed)
  with sharding.scope(mesh, rules):
    logical_state = jax.eval_shape(init_state, rng)
  return Setup(config, dataset, family, task, mesh, rules, model, optimizer, lr_schedule,
               batch_sharding, init_state, logical_state,
               sharding.logical_shardings(logical_state, mesh, rules), rng, batch)


def checked(config: ml_collections.ConfigDict, devices: Optional[list] = None,
            plan: bool = False) -> Setup:
  """The Setup of a config that config.validate passed, on `devices` (default: all), once
  its data (for a `plan`, but its size), its parameters' shardings and every process's
  batch rows are checked too (ConfigError if they do not fit). Writes nothing."""
  dataset = data.load(config.data, config.seed)
  cfg.validate_with_data(config, dataset, plan)
  setup = build(config, dataset, devices=devices)
  with setup.scope():
    cfg.validate_shardings(setup.param_table(), setup.mesh, setup.rules)
  for size in (config.train.batch_size, config.eval.batch_size):
    feed.rows_by_process(setup.batch_sharding, size)  # One block each, or ConfigError.
  return setup
