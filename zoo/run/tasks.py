"""Tasks: what a model's inputs are, how eval sums become metrics, what a step trains on.

A model family names its task (zoo.models), and so does a dataset (zoo.data); the
trainer reaches task semantics only through these objects:
- `inputs`: the batch fields the model takes, in order; `keywords`: those it takes by
  name where a batch has them (packed documents' segments and positions);
- `loss_sum(out, batch)` and `counted(batch)`: the summed training loss and the number
  of targets it is over (a train step's loss is their ratio over the global batch); `out`
  is the model's output: logits, or a language model's per-target losses (`token_stats`);
- `eval_sums(out, batch)`: what an eval batch adds up (zoo.run.steps.eval_step), and
  `metrics(sums, dataset)`: the eval metrics from those sums over the split;
- `tokens(batch)`: the tokens a train batch trains on (sequence tasks), for tokens/s;
- `figures(out, batch)`: sums over a train batch that are logged beside the loss, as
  their mean per counted target (DPO's rewards and log-probs per pair);
- `eval_sampler(model, dataset, mesh, seed, temperature, jit)`: what an eval shows besides
  metrics (the LM's sample, logged and written to TensorBoard).

Post-training tasks (DPO) train the models of another task (`MODEL_TASK`: language models)
and take their settings from the config (`make`).
"""
import math
from typing import TYPE_CHECKING, Any, Callable, Optional

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
import optax

from zoo.models import decode

if TYPE_CHECKING:
  from zoo.data.dataset import Dataset
  from zoo.store.metrics import MetricWriter


REPLY_TOKENS = 64  # The longest reply an eval samples from chat data.


class Task:
  """Classification: eval loss and accuracy; the base of the sequence tasks."""
  name = 'classification'
  inputs = ('inputs',)
  keywords: dict[str, str] = {}  # Batch field -> the model's keyword argument.
  sequences = False   # Targets are token sequences: a train step trains on every token.
  # Its batches may be fed in context parallelism's load-balanced order (the sequence
  # permuted with each token's position, zoo.parallel.context): the loss is order-free.
  balanced = False
  # Its steps may run with the sequence split over a 'context' mesh axis (sequence tasks
  # whose batches are fed as data, not sampled in the step).
  context_parallel = False

  def model_inputs(self, batch: dict) -> list:
    return [batch[k] for k in self.inputs]

  def model_keywords(self, batch: dict) -> dict:
    return {arg: batch[field] for field, arg in self.keywords.items() if field in batch}

  def target_weights(self, batch: dict) -> jax.Array:
    """Each target's weight: 1, or the batch's `mask` (packed documents' padding 0, and for
    chat data 0 outside the assistant's turns)."""
    if 'mask' in batch:
      return batch['mask'].astype(jnp.float32)
    return jnp.ones(batch['targets'].shape, jnp.float32)

  def token_stats(self, out: Any, batch: dict) -> tuple[jax.Array, jax.Array]:
    """(each target's cross-entropy, whether it is the argmax) from the model's output:
    logits here; a language model's own per-target figures (LanguageModel)."""
    logits = out.astype(jnp.float32)
    return (optax.softmax_cross_entropy_with_integer_labels(logits, batch['targets']),
            jnp.argmax(logits, axis=-1) == batch['targets'])

  def loss_sum(self, out: Any, batch: dict) -> jax.Array:
    """The cross-entropy summed over the targets that count."""
    return (self.token_stats(out, batch)[0] * self.target_weights(batch)).sum()

  def counted(self, batch: dict) -> jax.Array:
    """How many targets count in `loss_sum` (float32, at least 1)."""
    return jnp.maximum(self.target_weights(batch).sum(), 1.0)

  def figures(self, out: Any, batch: dict) -> dict:
    """Sums over a train batch logged beside the loss, each over `figure_total`."""
    del out, batch
    return {}

  def figure_total(self, batch: dict) -> jax.Array:
    """What the figures' sums are divided by over the global batch: `counted`."""
    return self.counted(batch)

  def train_example(self, example: dict) -> dict:
    """A train batch's row from the dataset's (a task that makes its own batches from the
    data, as GRPO's rollouts do from prompts, says their shapes)."""
    return example

  period = 1  # Steps between the points where a run may save (GRPO: num_iterations).

  def eval_sums(self, out: Any, batch: dict) -> dict:
    """Sums over an eval batch of loss, correct predictions and weight (per target for
    sequences); `weights` [B] masks the padded rows of the split's last batch."""
    losses, correct = self.token_stats(out, batch)
    rows = batch['weights'].reshape(batch['weights'].shape + (1,) * (losses.ndim - 1))
    weights = jnp.broadcast_to(rows, losses.shape) * self.target_weights(batch)
    return {'loss': (losses * weights).sum(), 'correct': (correct * weights).sum(),
            'weight': weights.sum()}

  def metrics(self, sums: dict, dataset: 'Dataset') -> dict:
    """Loss and accuracy (per token for sequences) from eval_step's sums over the split."""
    del dataset
    return {'eval/loss': float(sums['loss'] / sums['weight']),
            'eval/accuracy': float(sums['correct'] / sums['weight'])}

  def tokens(self, batch: dict) -> Optional[int]:
    return math.prod(batch['targets'].shape) if self.sequences else None

  def eval_sampler(self, model: Any, dataset: 'Dataset', mesh: jax.sharding.Mesh, seed: int,
                   temperature: float, jit: Callable
                   ) -> Optional[Callable[[Any, int, 'MetricWriter'], None]]:
    """(params, step, writer) -> None, run after each eval's metrics are written; None:
    the task shows nothing else. `jit(fn, *args, **kwargs)` jits fn with those bound (the
    run's Setup.jit, which keeps the program for a later run of the same build)."""
    del model, dataset, mesh, seed, temperature, jit
    return None


class LanguageModel(Task):
  """Next-token prediction; eval adds bits per token (per character for character text),
  bits per byte where the data knows each token's UTF-8 bytes, and a sample."""
  name = 'lm'
  # The model gets the targets too: it returns each one's loss, never the whole logits
  # (zoo.models.layers.token_losses).
  keywords = {'segments': 'segments_BL', 'positions': 'positions_BL', 'targets': 'targets_BL'}
  sequences = True
  balanced = True
  context_parallel = True

  def token_stats(self, out: Any, batch: dict) -> tuple[jax.Array, jax.Array]:
    return out['loss'], out['correct']

  def eval_sums(self, out: Any, batch: dict) -> dict:
    """Adds the targets' UTF-8 bytes where the batch has them: bits per byte."""
    sums = super().eval_sums(out, batch)
    if 'bytes' in batch:
      rows = batch['weights'][:, None] * self.target_weights(batch)
      sums['bytes'] = (batch['bytes'] * rows).sum()
    return sums

  def scores(self, out: Any, batch: dict) -> dict:
    """Each row's log-likelihood of its targets where `mask` is 1, and whether each of those
    targets is the likeliest token: how multiple-choice tasks (zoo.data.choice) and
    lm-evaluation-harness's requests (zoo.run.harness) are scored. {'loglik': [B] float32,
    'greedy': [B] bool}."""
    losses, correct = self.token_stats(out, batch)
    mask = batch['mask']
    greedy = (correct | (mask == 0)).all(axis=-1)
    return {'loglik': -(losses * mask).sum(axis=-1), 'greedy': greedy}

  def metrics(self, sums: dict, dataset: 'Dataset') -> dict:
    result = super().metrics(sums, dataset)
    result[f'eval/bits_per_{dataset.token_unit}'] = result['eval/loss'] / math.log(2)
    if 'bytes' in sums:  # Every target's bits over every target's bytes.
      result['eval/bits_per_byte'] = float(sums['loss'] / math.log(2) / sums['bytes'])
    return result

  def eval_sampler(self, model: Any, dataset: 'Dataset', mesh: jax.sharding.Mesh, seed: int,
                   temperature: float, jit: Callable
                   ) -> Callable[[Any, int, 'MetricWriter'], None]:
    """Continues the first quarter of the first held-out window (the same on every
    process), logs `sample at step N: prompt -> continuation` and writes it as text. Chat
    data: the assistant's reply to a held-out conversation's opening, up to its end."""
    if dataset.sample_prompt:
      prompt = np.asarray(dataset.sample_prompt, np.int32)[-(model.max_len - 1):]
      tokens = np.concatenate([prompt, np.zeros(REPLY_TOKENS, np.int32)])[None]
      prompt_len = len(prompt)
    else:
      tokens = next(iter(dataset.eval_batches(1, slice(0, 1))))['inputs']  # [1, seq_len]
      prompt_len = tokens.shape[1] // 4
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    gen = jit(decode.generate, model.apply, prompt_len=prompt_len, window=model.max_len,
              temperature=temperature, out_shardings=replicated)

    def sample(params, step, writer):
      rng = jax.random.fold_in(jax.random.key(seed), step)
      out = np.asarray(gen({'params': params}, tokens, rng=rng))[0]
      reply = out[prompt_len:]
      stops = np.flatnonzero(np.isin(reply, dataset.stop_ids)) if dataset.stop_ids else []
      reply = reply[:stops[0]] if len(stops) else reply
      prompt, text = dataset.decode(out[:prompt_len]), dataset.decode(reply)
      logging.info('sample at step %d: %r -> %r', step, prompt, text)
      writer.text(step, 'eval/sample', prompt + ' -> ' + text)
    return sample


class Seq2Seq(Task):
  """A target sequence from a source (teacher forcing); eval adds exact match.

  Exact match is the fraction of examples whose every target token is the argmax under
  teacher forcing: exactly the fraction that greedy decoding gets entirely right, since
  each greedy step then sees the true prefix.
  """
  name = 'seq2seq'
  inputs = ('inputs', 'decoder_inputs')
  sequences = True
  context_parallel = True

  def eval_sums(self, logits: jax.Array, batch: dict) -> dict:
    """Adds the examples whose every target is the argmax."""
    sums = super().eval_sums(logits, batch)
    correct = jnp.argmax(logits, axis=-1) == batch['targets']
    exact = correct.reshape(correct.shape[0], -1).all(axis=1)
    sums.update(exact=(exact * batch['weights']).sum(), examples=batch['weights'].sum())
    return sums

  def metrics(self, sums: dict, dataset: 'Dataset') -> dict:
    result = super().metrics(sums, dataset)
    result['eval/exact_match'] = float(sums['exact'] / sums['examples'])
    return result


DPO_LOSSES = ('sigmoid', 'ipo')


class Preference(LanguageModel):
  """Direct preference optimisation (Rafailov et al., arXiv:2305.18290) on pairs of
  completions of one prompt, the chosen and the rejected.

  A batch holds pairs: `inputs`, `targets` and `mask` [B, 2, L] (row 0 the chosen, row 1
  the rejected; the mask 1 on the completion's targets) and `reference` [B, 2], each
  completion's log-probability under the frozen reference model (zoo.run.reference computes
  them once per example). The model sees the 2B rows; a completion's log-probability is the
  sum of its masked targets' (the LM's per-target losses, never whole logits). With
  h = (chosen - its reference) - (rejected - its reference), each pair's loss is
  - `sigmoid`: -(1 - s) log sigmoid(beta h) - s log sigmoid(-beta h), s the
    `label_smoothing` (conservative DPO, Mitchell 2023: the probability that a label is
    flipped; TRL 1.16's sigmoid loss ignores it);
  - `ipo` (Azar et al., arXiv:2310.12036): (h' - 1 / (2 beta))^2, with h' the same
    difference of log-ratios each divided by its completion's length, as TRL computes it.
  The step's loss is the mean over the global batch's pairs. Figures and eval metrics use
  TRL's names: rewards/chosen and rewards/rejected (beta times the log-ratio),
  rewards/margins, rewards/accuracies (chosen's reward above rejected's), logps/chosen and
  logps/rejected (the policy's summed log-probabilities).
  """
  name = 'dpo'
  balanced = False  # Rows [B, 2, L]: not laid out for context parallelism.

  def __init__(self, beta: float = 0.1, loss: str = 'sigmoid', label_smoothing: float = 0.0):
    self.beta, self.loss, self.label_smoothing = beta, loss, label_smoothing

  @staticmethod
  def _rows(x: jax.Array) -> jax.Array:
    """[B, 2, ...] pairs -> [2B, ...] rows, chosen then rejected for each pair (each
    device's pairs stay on it: the reshape moves no data)."""
    return x.reshape((-1,) + x.shape[2:])

  def model_inputs(self, batch: dict) -> list:
    return [self._rows(x) for x in super().model_inputs(batch)]

  def model_keywords(self, batch: dict) -> dict:
    return {k: self._rows(v) for k, v in super().model_keywords(batch).items()}

  def pairs(self, out: Any, batch: dict) -> dict:
    """Each pair's loss and figures, [B] each."""
    mask = batch['mask'].astype(jnp.float32)                            # [B, 2, L]
    logps = -(out['loss'].reshape(mask.shape) * mask).sum(-1)          # [B, 2]
    ratios = logps - batch['reference'].astype(jnp.float32)
    if self.loss == 'ipo':
      h = (ratios / jnp.maximum(mask.sum(-1), 1.0)) @ jnp.array([1.0, -1.0])
      losses = (h - 1 / (2 * self.beta)) ** 2
    else:
      h = self.beta * (ratios[:, 0] - ratios[:, 1])
      s = self.label_smoothing
      losses = -(1 - s) * jax.nn.log_sigmoid(h) - s * jax.nn.log_sigmoid(-h)
    rewards = self.beta * ratios
    return {'loss': losses, 'rewards/chosen': rewards[:, 0], 'rewards/rejected': rewards[:, 1],
            'rewards/margins': rewards[:, 0] - rewards[:, 1],
            'rewards/accuracies': (rewards[:, 0] > rewards[:, 1]).astype(jnp.float32),
            'logps/chosen': logps[:, 0], 'logps/rejected': logps[:, 1]}

  def loss_sum(self, out: Any, batch: dict) -> jax.Array:
    return self.pairs(out, batch)['loss'].sum()

  def counted(self, batch: dict) -> jax.Array:
    """Pairs: the loss is their mean."""
    return jnp.asarray(batch['reference'].shape[0], jnp.float32)

  def figures(self, out: Any, batch: dict) -> dict:
    return {k: v.sum() for k, v in self.pairs(out, batch).items() if k != 'loss'}

  def eval_sums(self, out: Any, batch: dict) -> dict:
    weights = batch['weights'].astype(jnp.float32)
    sums = {k: (v * weights).sum() for k, v in self.pairs(out, batch).items()}
    sums['weight'] = weights.sum()
    return sums

  def metrics(self, sums: dict, dataset: 'Dataset') -> dict:
    del dataset
    return {f'eval/{k}': float(v / sums['weight']) for k, v in sums.items() if k != 'weight'}

  def tokens(self, batch: dict) -> Optional[int]:
    return math.prod(batch['targets'].shape)

  def eval_sampler(self, model, dataset, mesh, seed, temperature, jit):
    del model, dataset, mesh, seed, temperature, jit
    return None


GRPO_LOSSES = ('dapo', 'bnpo', 'grpo', 'dr_grpo')
REWARD_SCALES = ('group', 'batch', 'none')
IMPORTANCE_LEVELS = ('token', 'sequence')


class PolicyGradient(LanguageModel):
  """Group relative policy optimisation (GRPO, Shao et al., arXiv:2402.03300) on the
  completions a run samples itself (zoo.run.rollouts), as TRL 1.16 computes it.

  A batch holds completions after their prompts: `inputs`, `targets`, `segments`,
  `positions` [R, L] (left padding as segment 0), `mask` [R, L] (1 on the completion's
  targets), `advantages` [R], and where they matter `old_logps` (the sampling policy's
  log-probabilities, `num_iterations` > 1) and `ref_logps` (the reference's, `beta` > 0)
  [R, L]. Each completion token's log-probability is the model's at the sampling
  `temperature`; with r its ratio to the old one (exp of their difference; `importance`
  'sequence': the completion's mean log-ratio, GSPO, arXiv:2507.18071) and A its
  completion's advantage, the token's loss is -min(r A, clip(r, 1 - epsilon, 1 +
  epsilon_high) A), plus beta times the k3 estimate of KL to the reference, exp(ref - logp)
  - (ref - logp) - 1, times r with `kl_correction` (so that its gradient is the reverse
  KL's, unbiased: DeepSeek-V3.2, TRL 1.16's default). `loss` aggregates the tokens: 'dapo'
  and 'bnpo' their mean over the global batch (one figure in zoo: the step's batch is
  global, where TRL's bnpo is per device and accumulation step), 'grpo' each completion's
  mean then their mean, 'dr_grpo' their sum over completions x `max_completion_tokens`
  (Dr. GRPO, arXiv:2503.20783).
  Figures (means over the completion tokens): kl, entropy, clip_ratio/low, /high, /region.
  """
  name = 'grpo'
  balanced = False  # Its batches are its rollouts', sampled in place.
  context_parallel = False

  def __init__(self, temperature: float = 1.0, epsilon: float = 0.2, epsilon_high: float = 0.0,
               beta: float = 0.0, loss: str = 'dapo', importance: str = 'token',
               max_completion_tokens: int = 32, num_iterations: int = 1,
               kl_correction: bool = True, **unused):
    del unused  # The rollouts' settings (zoo.run.rollouts).
    self.temperature, self.epsilon = temperature, epsilon
    self.epsilon_high = epsilon_high or epsilon
    self.beta, self.loss, self.importance = beta, loss, importance
    self.max_completion_tokens, self.num_iterations = max_completion_tokens, num_iterations
    self.kl_correction = kl_correction

  @property
  def period(self) -> int:
    """Steps per rollout: checkpoints fall between rollouts only."""
    return self.num_iterations

  def model_keywords(self, batch: dict) -> dict:
    return {**super().model_keywords(batch), 'temperature': self.temperature, 'entropy': True}

  def train_example(self, example: dict) -> dict:
    """A train batch's row from a prompt's (what the state and steps are built for)."""
    length = example['prompt'].shape[1] + self.max_completion_tokens - 1
    row = {k: np.zeros((1, length), np.int32) for k in
           ('inputs', 'targets', 'segments', 'positions', 'mask')}
    row['advantages'] = np.zeros((1,), np.float32)
    for field, used in (('old_logps', self.num_iterations > 1), ('ref_logps', self.beta > 0)):
      if used:
        row[field] = np.zeros((1, length), np.float32)
    return row

  def per_token(self, out: Any, batch: dict) -> dict:
    """Each token's loss and figures [R, L] (or [R, 1] per completion)."""
    logp = -out['loss']
    old = batch['old_logps'] if 'old_logps' in batch else jax.lax.stop_gradient(logp)
    log_ratio = logp - old
    mask = batch['mask'].astype(jnp.float32)
    if self.importance == 'sequence':
      log_ratio = ((log_ratio * mask).sum(-1) / jnp.maximum(mask.sum(-1), 1.0))[:, None]
    ratio = jnp.exp(log_ratio)
    clipped = jnp.clip(ratio, 1 - self.epsilon, 1 + self.epsilon_high)
    a = batch['advantages'].astype(jnp.float32)[:, None]
    loss = -jnp.minimum(ratio * a, clipped * a)
    low = (ratio < 1 - self.epsilon) & (a < 0)
    high = (ratio > 1 + self.epsilon_high) & (a > 0)
    figures = {'entropy': out['entropy'], 'clip_ratio/low': low, 'clip_ratio/high': high,
               'clip_ratio/region': low | high}
    if self.beta:
      delta = batch['ref_logps'] - logp
      figures['kl'] = jnp.exp(delta) - delta - 1
      if self.kl_correction:  # Unbiased off the sampling policy, and on it (DeepSeek-V3.2).
        figures['kl'] = figures['kl'] * ratio
      loss = loss + self.beta * figures['kl']
    return {'loss': loss, **figures}

  def loss_sum(self, out: Any, batch: dict) -> jax.Array:
    mask = batch['mask'].astype(jnp.float32)
    per_token = self.per_token(out, batch)['loss'] * mask
    if self.loss == 'grpo':
      return (per_token.sum(-1) / jnp.maximum(mask.sum(-1), 1.0)).sum()
    return per_token.sum()

  def counted(self, batch: dict) -> jax.Array:
    rows = batch['advantages'].shape[0]
    if self.loss == 'grpo':
      return jnp.asarray(rows, jnp.float32)
    if self.loss == 'dr_grpo':
      return jnp.asarray(rows * self.max_completion_tokens, jnp.float32)
    return jnp.maximum(batch['mask'].sum(dtype=jnp.float32), 1.0)

  def figures(self, out: Any, batch: dict) -> dict:
    mask = batch['mask'].astype(jnp.float32)
    return {k: jax.lax.stop_gradient(v.astype(jnp.float32) * mask).sum()
            for k, v in self.per_token(out, batch).items() if k != 'loss'}

  def figure_total(self, batch: dict) -> jax.Array:
    """Figures are means over the completion tokens."""
    return jnp.maximum(batch['mask'].sum(dtype=jnp.float32), 1.0)

  def tokens(self, batch: dict) -> Optional[int]:
    return math.prod(batch['targets'].shape)

  def eval_sampler(self, model, dataset, mesh, seed, temperature, jit):
    del model, dataset, mesh, seed, temperature, jit
    return None


TASKS: dict[str, Task] = {t.name: t for t in (Task(), LanguageModel(), Seq2Seq(), Preference(),
                                              PolicyGradient())}
# Post-training tasks -> the task of the models they train.
MODEL_TASK = {'dpo': 'lm', 'grpo': 'lm'}


def model_task(name: str) -> str:
  """The task of the models that data of task `name` trains."""
  return MODEL_TASK.get(name, name)


def make(name: str, config: Any) -> Task:
  """The task `name` with the run's settings (config.dpo for DPO)."""
  if name == 'dpo':
    return Preference(**dict(config.get('dpo', {})))
  if name == 'grpo':
    return PolicyGradient(**dict(config.get('grpo', {})))
  return TASKS[name]
