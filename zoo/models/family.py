"""What zoo knows of a model family: its module, the task it solves and its config checks.

Each family file ends with `FAMILY = ModelFamily(...)`, and `zoo.models.MODELS` maps a
`config.model.name` to it: adding a family is one file plus one registry line.
"""
import dataclasses
from typing import Callable, Optional, Sequence

import flax.linen as nn
import ml_collections
import numpy as np


def _no_check(*args) -> None:
  del args


@dataclasses.dataclass(frozen=True)
class ModelFamily:
  """A model family: the trainer reaches its module, task and checks only through this."""
  # Built with config.model's fields (less `name`) plus the data's (e.g. num_classes).
  module: type[nn.Module]
  task: str                 # A key of zoo.run.tasks.TASKS: the data it trains on and its metrics.
  # (config.model) -> None: checks the family's own fields before any data loads; raises
  # zoo.errors.ConfigError (through errors.fail) naming the field.
  check_config: Callable[[ml_collections.ConfigDict], None] = _no_check
  # (config.model, one example's model inputs) -> None: checks the fields against the data.
  check_inputs: Callable[[ml_collections.ConfigDict, Sequence[np.ndarray]], None] = _no_check
  # (model, batch size, sequence length) -> train-step FLOPs by a closed formula, logged
  # beside the traced count (zoo.run.perf.step_cost); None where the family has none.
  analytic_flops: Optional[Callable[[nn.Module, int, int], int]] = None
