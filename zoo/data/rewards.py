"""Reward functions for reinforcement learning (GRPO): Python callables that the config names
as `module:function` (`grpo.rewards`, weighted by `grpo.reward_weights`).

A reward function is called as TRL calls one: `fn(prompts=[...], completions=[...],
completion_ids=[...], **columns)`, with the prompts and completions as text (a completion
up to its end token, which is left out), the completions' token ids, and each field of the
prompts' records (zoo.data.prompts: e.g. `answer=[...]`) as a list in the same order. It
returns one number per completion, or None where it does not apply (that function then
adds nothing to the completion's reward). A function that raises, returns NaN or infinity,
or returns the wrong number of values stops the run with one line naming it and the
prompt (RewardError). zoo.data.sorting has the shipped task's.
"""
import dataclasses
import importlib
import math
from typing import Any, Callable, Sequence

import numpy as np

from zoo.errors import ConfigError, ZooError, first_line


class RewardError(ZooError):
  """A reward function failed on the run's completions."""


@dataclasses.dataclass(frozen=True)
class Reward:
  name: str           # module:function, as the config names it.
  fn: Callable
  weight: float


def load(specs: Sequence[str], weights: Sequence[float], field: str = 'config.grpo.rewards'
         ) -> list[Reward]:
  """The reward functions `specs` names, or ConfigError naming `field` and the spec."""
  if isinstance(specs, str) or not specs:
    raise ConfigError(f'{field}: give a tuple of reward functions as "module:function", e.g. '
                      "('zoo.data.sorting:exact',); got " + repr(specs))
  if weights and len(weights) != len(specs):
    raise ConfigError(f'config.grpo.reward_weights: {len(weights)} weights for {len(specs)} '
                      'reward functions; give one each, or () for all 1')
  out = []
  for spec, weight in zip(specs, weights or [1.0] * len(specs)):
    module_name, _, name = str(spec).partition(':')
    try:
      fn = getattr(importlib.import_module(module_name), name) if name else None
    except Exception as e:  # pylint: disable=broad-except  # The user's module: any error.
      raise ConfigError(f'{field}: {spec}: importing {module_name} raised {type(e).__name__}: '
                        f'{first_line(e)}') from None
    if not callable(fn):
      raise ConfigError(f'{field}: {spec} is not a function; give "module:function" with the '
                        'module importable from here')
    if not math.isfinite(float(weight)):
      raise ConfigError(f'config.grpo.reward_weights: {weight} for {spec} is not finite')
    out.append(Reward(str(spec), fn, float(weight)))
  return out


def _check(reward: Reward, values: Any, prompts: list, completions: list) -> np.ndarray:
  """The values as float64 (None: NaN), or RewardError naming the function and a prompt."""
  try:
    n = len(values)
  except TypeError:
    n = None
  if n != len(completions):
    got = f'a {type(values).__name__}' if n is None else f'{n} values'
    raise RewardError(f'reward {reward.name} returned {got} for {len(completions)} completions '
                      f'(the first of prompt {prompts[0]!r}); return one number (or None) per '
                      'completion')
  out = np.full(n, np.nan)
  for i, v in enumerate(values):
    if v is None:
      continue
    try:
      out[i] = float(v)
    except (TypeError, ValueError):
      out[i] = np.inf
    if not np.isfinite(out[i]):
      raise RewardError(f'reward {reward.name} returned {v!r} for the completion '
                        f'{completions[i]!r} of prompt {prompts[i]!r}; return a finite number '
                        '(or None where it does not apply)')
  return out


def score(rewards: list[Reward], prompts: list[str], completions: list[str],
          completion_ids: list[list[int]], columns: dict) -> np.ndarray:
  """Each function's rewards [N, F] (NaN where it returned None)."""
  out = []
  for reward in rewards:
    call = lambda rows, r=reward: r.fn(
        prompts=[prompts[i] for i in rows], completions=[completions[i] for i in rows],
        completion_ids=[completion_ids[i] for i in rows],
        **{k: [v[i] for i in rows] for k, v in columns.items()})
    try:
      values = call(range(len(prompts)))
    except Exception as e:  # pylint: disable=broad-except  # The user's function: any error.
      where = next((i for i in range(len(prompts)) if _raises(call, i)), 0)
      raise RewardError(f'reward {reward.name} raised {type(e).__name__}: {first_line(e)} (on the '
                        f'completion {completions[where]!r} of prompt {prompts[where]!r})'
                        ) from None
    out.append(_check(reward, values, prompts, completions))
  return np.stack(out, axis=1)


def _raises(call: Callable, i: int) -> bool:
  try:
    call([i])
    return False
  except Exception:  # pylint: disable=broad-except
    return True
