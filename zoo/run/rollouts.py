"""Rollouts: the batch source of reinforcement learning (GRPO), beside the data feed in the
one training loop.

Every `grpo.num_iterations` steps, the prompts of the step (train.batch_size /
num_generations of them, the same on every process: a pure function of seed and step) are
each completed num_generations times on the live, sharded parameters
(zoo.models.decode.rollout: each row stops at the tokenizer's end token, done rows leave
the batch down to one per batch shard, and the batch ends when every row is done), with
the key fold_in(fold_in(key(seed), 2), step): a resumed run draws the same completions.
Every process scores all completions with the reward functions (zoo.data.rewards), turns
them into advantages (TRL 1.16's: the weighted sum of the functions' rewards, minus its
group's mean, over the group's or the batch's standard deviation + 1e-4, or not scaled),
and feeds its rows of the train batch (prompt + completion, left padding as segment 0).
The old policy's log-probabilities (num_iterations > 1) and the reference's (beta > 0: the
run's starting parameters, `checkpoint.init_from`'s or the seed's fresh ones; with LoRA
the base, adapters off) come from one forward program.

Evaluation completes every held-out prompt twice, sampled at the training temperature and
greedily, and reports the mean reward of each function for both.
"""
import time
from typing import Any, Optional

from absl import logging
import flax
import jax
import jax.numpy as jnp
import numpy as np

from zoo.data import feed, rewards as rewards_lib
from zoo.models import decode, lora
from zoo.parallel import sharding
from zoo.run import setup as setup_lib
from zoo.run import steps
from zoo.store import checkpoint


def without_adapters(params: Any) -> Any:
  """LoRA parameters with every adapter's B at zero: the base model."""
  flat = flax.traverse_util.flatten_dict(params)
  return flax.traverse_util.unflatten_dict({
      k: jnp.zeros_like(v) if lora.is_adapter(k) and str(k[-1]).endswith('b') else v
      for k, v in flat.items()})


def advantages(total: np.ndarray, groups: int, scale: str) -> np.ndarray:
  """Each completion's advantage from its reward (NaN: unscorable), grouped by prompt in
  consecutive runs of `groups`, as TRL 1.16 computes it (unbiased standard deviations)."""
  grouped = total.reshape(-1, groups)
  mean = np.nanmean(grouped, axis=1, keepdims=True)
  if scale == 'batch':
    std = np.full_like(grouped, _nanstd(total))
  else:
    std = np.broadcast_to(_nanstd(grouped, axis=1, keepdims=True), grouped.shape)
  out = grouped - mean
  if scale != 'none':
    out = out / (std + 1e-4)
  return np.nan_to_num(out, nan=0.0).reshape(-1).astype(np.float32)


def _nanstd(x: np.ndarray, **kwargs) -> np.ndarray:
  with np.errstate(invalid='ignore', divide='ignore'):
    return np.nanstd(x, ddof=1, **kwargs)


def train_rows(prompts: np.ndarray, pad: np.ndarray, tokens: np.ndarray, lengths: np.ndarray
               ) -> dict:
  """The train batch's fields of prompts [R, P] (left-padded by `pad`) and completions
  [R, N] (each `lengths` long): inputs, targets, segments, positions [R, P + N - 1], and
  mask, 1 on the completion's targets."""
  whole = np.concatenate([prompts, tokens], axis=1)
  at = np.arange(whole.shape[1])[None, :]
  width = prompts.shape[1]
  real = (at >= pad[:, None]) & (at < width + lengths[:, None])
  positions = np.maximum(np.cumsum(real, axis=1) - 1, 0)
  target = at[:, 1:]
  mask = (target >= width) & (target < width + lengths[:, None])
  return {'inputs': whole[:, :-1].astype(np.int32), 'targets': whole[:, 1:].astype(np.int32),
          'segments': real[:, :-1].astype(np.int32),
          'positions': positions[:, :-1].astype(np.int32),
          'mask': mask.astype(np.int32)}


def program(setup: setup_lib.Setup) -> Any:
  """The run's rollout, jitted: (params, prompts [R, P], pad [R], rng, temperature (static))
  -> decode.rollout's arrays, replicated; the prompts split over the batch's shards, done
  rows leaving the batch down to one per shard."""
  grpo, mesh = setup.config.grpo, setup.mesh
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return setup.jit(_generate, setup.model, setup.batch_sharding, grpo.max_completion_tokens,
                   grpo.top_k, grpo.top_p, tuple(int(i) for i in setup.dataset.stop_ids or ()),
                   sharding.batch_shards(mesh, setup.rules),
                   in_shardings=(setup.state_shardings.params, replicated, replicated, None),
                   out_shardings=replicated, static_argnums=4)


def _generate(model, batch_sharding, max_tokens, top_k, top_p, stop_ids, shards, params, prompts,
              pad, rng, temperature):
  """`program`'s function, its settings bound first."""
  prompts = jax.lax.with_sharding_constraint(prompts, batch_sharding)
  pad = jax.lax.with_sharding_constraint(pad, batch_sharding)
  return decode.rollout(model, params, prompts, pad, max_tokens, rng, temperature, top_k, top_p,
                        stop_ids, shards)


def _score(model, task, params, batch):
  """Each target's log-probability at the temperature (0 off the mask)."""
  out = model.apply({'params': params}, *task.model_inputs(batch), **task.model_keywords(batch))
  return -out['loss'] * batch['mask']


def abstract_inputs(setup: setup_lib.Setup) -> tuple:
  """What `program` takes after the parameters, as shapes: one rollout of the train batch
  (train.batch_size rows: num_generations of each prompt) and its temperature."""
  rows, width = setup.batch['inputs'].shape
  length = width + 1 - setup.config.grpo.max_completion_tokens  # Prompt + completion - 1.
  return (jax.ShapeDtypeStruct((rows, length), jnp.int32),
          jax.ShapeDtypeStruct((rows,), jnp.int32), jax.eval_shape(lambda: jax.random.key(0)),
          setup.task.temperature)


def holds_reference(setup: setup_lib.Setup) -> bool:
  """Whether a run keeps reference parameters beside the policy's: with a KL term (beta >
  0), unless it trains LoRA adapters (the reference is then the base, adapters off)."""
  return bool(setup.task.beta) and not setup.trainable


def reference_bytes(setup: setup_lib.Setup, params: Any) -> int:
  """Per device, the reference parameters a GRPO run keeps resident beside the policy's
  `params` (holds_reference); 0 for other tasks."""
  if setup.task.name != 'grpo' or not holds_reference(setup):
    return 0
  return sharding.per_device_bytes(params)


class Rollouts:
  """The GRPO batches of a run: `batch(state, step)`, its figures in `metrics`, and
  `evaluate(params, step)`."""

  def __init__(self, setup: setup_lib.Setup):
    self.setup, config = setup, setup.config
    self.task, self.g = setup.task, config.grpo.num_generations
    self.rewards = rewards_lib.load(tuple(config.grpo.rewards), tuple(config.grpo.reward_weights))
    self.scale, self.mask_truncated = config.grpo.scale_rewards, config.grpo.mask_truncated
    self.dataset, self.seed = setup.dataset, config.seed
    params_sharding = setup.state_shardings.params
    self.batch_sharding = setup.batch_sharding
    self.generate = program(setup)

    self.score = setup.jit(_score, setup.model, self.task,
                           in_shardings=(params_sharding, setup.batch_sharding),
                           out_shardings=setup.batch_sharding)
    self.reference = self._reference() if holds_reference(setup) else None
    # LoRA's reference: the base, adapters off, placed as the parameters are.
    self.base = setup.jit(without_adapters, out_shardings=params_sharding)
    self.current: Optional[dict] = None
    self.metrics: dict = {}

  def _reference(self) -> Any:
    """The reference parameters (with LoRA none: the base, adapters off, in `_ref_params`)."""
    setup, config = self.setup, self.setup.config
    if config.checkpoint.init_from:
      with setup.scope():
        params, _, _ = checkpoint.restore_params(config.checkpoint.init_from,
                                                 setup.abstract_state().params)
      return params
    return setup.create_state().params  # The seed's: a pure function of it.

  def _ref_params(self, params: Any) -> Any:
    return self.reference if self.reference is not None else self.base(params)

  def _complete(self, params: Any, batch: dict, rng: jax.Array, temperature: float,
                repeat: int) -> tuple[dict, dict, list, list]:
    """(completions as numpy, repeated prompts, prompt texts, completion texts)."""
    prompts = {k: np.repeat(v, repeat, axis=0) for k, v in batch.items()}
    out = jax.device_get(self.generate(params, prompts['prompt'], prompts['pad'], rng,
                                       temperature))
    decode_ = self.dataset.decode
    texts = [decode_(p[n:]) for p, n in zip(prompts['prompt'], prompts['pad'])]
    stops = np.isin(out['tokens'], self.dataset.stop_ids) & out['mask'].astype(bool)
    ends = np.where(stops.any(1), stops.argmax(1), out['lengths'])  # The stop token left out.
    completions = [decode_(t[:e]) for t, e in zip(out['tokens'], ends)]
    return out, prompts, texts, completions

  def _score(self, prompts: dict, texts: list, completions: list, out: dict, split: str
             ) -> np.ndarray:
    """Each function's rewards [R, F]."""
    records = [self.dataset.records[split][int(i)] for i in prompts['index']]
    columns = {k: [r.get(k) for r in records] for k in sorted({k for r in records for k in r})}
    ids = [list(t[:n]) for t, n in zip(out['tokens'], out['lengths'])]
    return rewards_lib.score(self.rewards, texts, completions, ids, columns)

  def batch(self, state: steps.TrainState, step: int) -> dict:
    """The global train batch of `step` (a new rollout every num_iterations steps)."""
    if step % self.task.period and self.current is not None:
      return self.current
    setup = self.setup
    size = setup.config.train.batch_size
    jax.block_until_ready(state.params)  # The update before: not the rollout's time.
    t0 = time.perf_counter()
    prompts = self.dataset.train_batch(step, size // self.g, slice(0, size // self.g))
    rng = jax.random.fold_in(jax.random.fold_in(jax.random.key(self.seed), 2), step)
    out, prompts, texts, completions = self._complete(state.params, prompts, rng,
                                                      self.task.temperature, self.g)
    generated = time.perf_counter() - t0
    per_function = self._score(prompts, texts, completions, out, 'train')
    weights = np.array([r.weight for r in self.rewards])
    total = np.where(np.isnan(per_function).all(1), np.nan,
                     np.nansum(per_function * weights, axis=1))
    rows = train_rows(prompts['prompt'], prompts['pad'], out['tokens'], out['lengths'])
    if self.mask_truncated:
      rows['mask'] = rows['mask'] * ~out['truncated'][:, None]
    rows['advantages'] = advantages(total, self.g, self.scale)
    mine = feed.process_rows(self.batch_sharding, size)
    batch = feed.to_global({k: v[mine] for k, v in rows.items()}, self.batch_sharding, size)
    with setup.scope():
      if self.task.num_iterations > 1:
        batch['old_logps'] = self.score(state.params, batch)
      if self.task.beta:
        batch['ref_logps'] = self.score(self._ref_params(state.params), batch)
    self.current = batch
    lengths = out['lengths']
    self.metrics = {
        'train/reward': float(np.nanmean(total)), 'train/reward_std': float(_nanstd(total)),
        'train/frac_reward_zero_std': float(np.mean(
            np.isclose(_nanstd(total.reshape(-1, self.g), axis=1), 0))),
        'train/completions/mean_length': float(lengths.mean()),
        'train/completions/max_length': float(lengths.max()),
        'train/completions/min_length': float(lengths.min()),
        'train/completions/truncated': float(out['truncated'].mean()),
        'perf/rollout_s': time.perf_counter() - t0,
        'perf/rollout_tokens_per_s': float(lengths.sum()) / generated}
    for reward, values in zip(self.rewards, per_function.T):
      self.metrics[f'train/rewards/{reward.fn.__name__}/mean'] = float(np.nanmean(values))
      self.metrics[f'train/rewards/{reward.fn.__name__}/std'] = float(_nanstd(values))
    return batch

  def evaluate(self, params: Any, step: int) -> dict:
    """Each reward function's mean over the held-out prompts (the first eval.max_batches
    batches), sampled at the training temperature and greedy; the completions' length."""
    config = self.setup.config
    size = config.eval.batch_size
    rng = jax.random.fold_in(jax.random.fold_in(jax.random.key(self.seed), 3), step)
    sums: dict = {}
    batches = self.dataset.eval_batches(size, slice(0, size))
    for i, batch in enumerate(batches):
      if config.eval.max_batches and i >= config.eval.max_batches:
        break
      weights = batch.pop('weights')
      for mode, temperature in (('sampled', self.task.temperature), ('greedy', 0.0)):
        out, prompts, texts, completions = self._complete(params, batch, jax.random.fold_in(
            rng, i), temperature, 1)
        per_function = np.nan_to_num(self._score(prompts, texts, completions, out, 'val'))
        for reward, values in zip(self.rewards, per_function.T):
          key = f'eval/{mode}/{reward.fn.__name__}'
          sums[key] = sums.get(key, 0.0) + float((values * weights).sum())
        key = f'eval/{mode}/completion_length'
        sums[key] = sums.get(key, 0.0) + float((out['lengths'] * weights).sum())
      sums['weight'] = sums.get('weight', 0.0) + float(weights.sum())
    weight = sums.pop('weight')
    result = {k: v / weight for k, v in sums.items()}
    logging.info('eval at step %d: %d held-out prompts', step, int(weight))
    return result


def make(setup: setup_lib.Setup) -> Optional[Rollouts]:
  """The run's rollouts if its task samples its own batches (GRPO), else None."""
  return Rollouts(setup) if setup.task.name == 'grpo' else None

