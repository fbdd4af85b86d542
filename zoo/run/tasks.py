"""Tasks: what a model's inputs are, how eval sums become metrics, what a step trains on.

A model family names its task (zoo.models), and so does a dataset (zoo.data); the
trainer reaches task semantics only through these objects:
- `inputs`: the batch fields the model takes, in order; `keywords`: those it takes by
  name where a batch has them (packed documents' segments and positions);
- `metrics(sums, dataset)`: eval metrics from the summed outputs of zoo.run.steps.eval_step;
- `tokens(batch)`: the tokens a train batch trains on (sequence tasks), for tokens/s;
- `eval_sampler(model, dataset, mesh, seed, temperature)`: what an eval shows besides
  metrics (the LM's sample, logged and written to TensorBoard).
"""
import functools
import math
from typing import TYPE_CHECKING, Any, Callable, Optional

from absl import logging
import jax
import numpy as np

from zoo.models import decode

if TYPE_CHECKING:
  from zoo.data.dataset import Dataset
  from zoo.store.metrics import MetricWriter


class Task:
  """Classification: eval loss and accuracy; the base of the sequence tasks."""
  name = 'classification'
  inputs = ('inputs',)
  keywords: dict[str, str] = {}  # Batch field -> the model's keyword argument.
  sequences = False   # Targets are token sequences: a train step trains on every token.

  def model_inputs(self, batch: dict) -> list:
    return [batch[k] for k in self.inputs]

  def model_keywords(self, batch: dict) -> dict:
    return {arg: batch[field] for field, arg in self.keywords.items() if field in batch}

  def metrics(self, sums: dict, dataset: 'Dataset') -> dict:
    """Loss and accuracy (per token for sequences) from eval_step's sums over the split."""
    del dataset
    return {'eval/loss': float(sums['loss'] / sums['weight']),
            'eval/accuracy': float(sums['correct'] / sums['weight'])}

  def tokens(self, batch: dict) -> Optional[int]:
    return math.prod(batch['targets'].shape) if self.sequences else None

  def eval_sampler(self, model: Any, dataset: 'Dataset', mesh: jax.sharding.Mesh, seed: int,
                   temperature: float) -> Optional[Callable[[Any, int, 'MetricWriter'], None]]:
    """(params, step, writer) -> None, run after each eval's metrics are written; None:
    the task shows nothing else."""
    del model, dataset, mesh, seed, temperature
    return None


class LanguageModel(Task):
  """Next-token prediction; eval adds bits per token (per character for character text),
  bits per byte where the data knows each token's UTF-8 bytes, and a sample."""
  name = 'lm'
  keywords = {'segments': 'segments_BL', 'positions': 'positions_BL'}
  sequences = True

  def metrics(self, sums: dict, dataset: 'Dataset') -> dict:
    result = super().metrics(sums, dataset)
    result[f'eval/bits_per_{dataset.token_unit}'] = result['eval/loss'] / math.log(2)
    if 'bytes' in sums:  # Every target's bits over every target's bytes.
      result['eval/bits_per_byte'] = float(sums['loss'] / math.log(2) / sums['bytes'])
    return result

  def eval_sampler(self, model: Any, dataset: 'Dataset', mesh: jax.sharding.Mesh, seed: int,
                   temperature: float) -> Callable[[Any, int, 'MetricWriter'], None]:
    """Continues the first quarter of the first held-out window (the same on every
    process), logs `sample at step N: prompt -> continuation` and writes it as text."""
    tokens = next(iter(dataset.eval_batches(1, slice(0, 1))))['inputs']  # [1, seq_len]
    prompt_len = tokens.shape[1] // 4
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    gen = jax.jit(functools.partial(decode.generate, model.apply, prompt_len=prompt_len,
                                    window=model.max_len, temperature=temperature),
                  out_shardings=replicated)

    def sample(params, step, writer):
      rng = jax.random.fold_in(jax.random.key(seed), step)
      out = np.asarray(gen({'params': params}, tokens, rng=rng))
      prompt, text = dataset.decode(out[0, :prompt_len]), dataset.decode(out[0, prompt_len:])
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

  def metrics(self, sums: dict, dataset: 'Dataset') -> dict:
    result = super().metrics(sums, dataset)
    result['eval/exact_match'] = float(sums['exact'] / sums['examples'])
    return result


TASKS: dict[str, Task] = {t.name: t for t in (Task(), LanguageModel(), Seq2Seq())}
