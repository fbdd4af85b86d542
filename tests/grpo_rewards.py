"""Rewards for grpo_test's runs, named 'grpo_rewards:<function>' in their configs: a module
of their own, so that the processes of a multi-process run import NumPy for them, not the
tests' torch, transformers and TRL (5 s of start-up each)."""
import numpy as np


def low_ids(completion_ids, **unused):
  """The fraction of a completion's tokens below 128 (a random model's: about half)."""
  del unused
  return [float(np.mean(np.asarray(ids) < 128)) if len(ids) else 0.0 for ids in completion_ids]


def shuffled_low_ids(prompts, completion_ids, **unused):
  """low_ids shuffled among the batch's completions: unrelated to each completion."""
  del unused
  values = low_ids(completion_ids)
  order = np.random.default_rng(len(prompts) + sum(map(len, completion_ids))).permutation(
      len(values))
  return [values[i] for i in order]


def raises(completions, **unused):
  del unused
  if any('7' in c for c in completions):
    raise RuntimeError('no sevens')
  return [0.0] * len(completions)


def nan(completions, **unused):
  del unused
  return [float('nan')] + [0.0] * (len(completions) - 1)


def short(completions, **unused):
  del unused
  return [0.0] * (len(completions) - 1)
