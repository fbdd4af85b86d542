"""A zoo run as a model of EleutherAI's lm-evaluation-harness (`python -m zoo.evaluate`).

`ZooLM` implements the harness's model API over a run's newest checkpoint (trained or
imported), sharded on the devices present: `loglikelihood` (the harness's own tokenizing
of each context and continuation, TemplateLM._encode_pair), `loglikelihood_rolling` (its
rolling windows of max_len tokens after the end-of-text token), and `generate_until`
(greedy, or sampled with the request's temperature, through the key/value cache,
stopping at the request's `until` strings or the end-of-text token). Requests are scored
in batches of `batch_size` rows of the model's max_len, right-padded (steps.score_step),
the rows sharded over the mesh's batch axis; every process runs every request and gets
every result, process 0 writes them. Registered as the harness's model "zoo":
`lm_eval.simple_evaluate(model="zoo", model_args="workdir=runs/lm")`.

Needs the `eval` extra (`pip install -e '.[eval]'`): lm-eval is not a core dependency.
"""
import functools
import json
import os
from typing import Any, Optional

from absl import logging
import jax
import numpy as np

from zoo.data import feed
from zoo.errors import ConfigError
from zoo.models import decode
from zoo.run import memory
from zoo.run import setup as setup_lib
from zoo.run import workdir as workdir_lib
from zoo.store import checkpoint

try:
  import lm_eval.models  # pylint: disable=unused-import  # The harness's own first (lazily):
  # registering "zoo" into an empty registry would hide them.
  from lm_eval import utils as lm_utils
  from lm_eval.api.model import TemplateLM
  from lm_eval.api.registry import register_model
except ImportError as e:  # The command says what to install (zoo.evaluate).
  raise ConfigError("zoo.evaluate needs lm-evaluation-harness: pip install -e '.[eval]' "
                    f'({e})') from None

PROMPT_BUCKET = 64  # Prompts are left-padded to a multiple of this: fewer shapes to compile.


@register_model('zoo')
class ZooLM(TemplateLM):
  """The harness's model API over the newest checkpoint of `workdir`."""

  def __init__(self, workdir: str, batch_size: int = 16, mesh_shape: str = '',
               max_gen_toks: int = 256, seed: int = 0, **kwargs):
    super().__init__()
    del kwargs  # The harness passes its own (device, dtype...): zoo's run decides those.
    batch_size, max_gen_toks, seed = int(batch_size), int(max_gen_toks), int(seed)
    if batch_size <= 0:
      raise ConfigError(f'--batch_size: must be positive, got {batch_size}')
    if max_gen_toks <= 0:
      raise ConfigError(f'--max_gen_toks: must be positive, got {max_gen_toks}')
    if seed < 0:
      raise ConfigError(f'--seed: must be >= 0, got {seed}')
    config, directory = workdir_lib.load_run(workdir)  # A language model's, or ConfigError.
    self.dataset = workdir_lib.run_dataset(workdir, config)
    if self.dataset.encode is None:
      raise ConfigError(f'--workdir: the data of {workdir} has no tokenizer; the harness scores '
                        'text')
    self.setup = setup = setup_lib.placed(config, self.dataset, mesh_shape, batch_size,
                                          'evaluating')
    self.max_gen_toks, self.seed = max_gen_toks, seed
    row_bytes = 4 * setup.model.max_len * (3 + setup.model.vocab_size)  # Its tokens and logits.
    host = memory.host_bytes_available()
    if host is not None and batch_size * row_bytes > host / 2:
      raise ConfigError(f'--batch_size: {batch_size} rows of {setup.model.max_len} tokens need '
                        f'{batch_size * row_bytes / 2**30:.1f} GiB of host memory, more than half '
                        f'the {host / 2**30:.1f} GiB free; give fewer')
    self.batch_size = batch_size  # placed() splits the rows over the mesh only if they divide.
    with setup.scope():
      self.params, step, _ = checkpoint.restore_params(
          directory, setup.abstract_state().params, field='--workdir')
      self._score = setup.jit_score_step()
    logging.info('lm-evaluation-harness: step %d of %s on mesh %s, %d rows per batch', step,
                 directory, dict(setup.mesh.shape), self.batch_size)
    self._generators = {}

  # What the harness asks of a model.
  @property
  def eot_token_id(self) -> int:
    """The end-of-text token: the data's end-of-document token, else a newline's."""
    if self.dataset.eos_id is not None:
      return self.dataset.eos_id
    newline = self.dataset.encode('\n')
    return int(newline[0]) if len(newline) else 0

  @property
  def max_length(self) -> int:
    return self.setup.model.max_len

  @property
  def tokenizer_name(self) -> str:
    return self.setup.config.data.get('path') or 'zoo'

  def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None,
                 **kwargs) -> list[int]:
    del add_special_tokens, kwargs
    return [int(i) for i in self.dataset.encode(string)]

  def tok_decode(self, tokens: list[int]) -> str:
    return self.dataset.decode(np.asarray(tokens, np.int32))

  def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False,
                            override_bs: Optional[int] = None) -> list[tuple[float, bool]]:
    """(log-likelihood, greedy) of each request's continuation tokens after its context
    tokens, the pair cut from the left to max_len + 1 tokens, as the harness's hf model."""
    del disable_tqdm, override_bs
    length, results = self.max_length, []
    for start in range(0, len(requests), self.batch_size):
      chunk = requests[start:start + self.batch_size]
      batch = {k: np.zeros((self.batch_size, length), np.int32) for k in ('inputs', 'targets')}
      batch['mask'] = np.zeros((self.batch_size, length), np.float32)
      for row, (_, context, continuation) in enumerate(chunk):
        whole = np.asarray(list(context) + list(continuation), np.int32)[-(length + 1):]
        n = len(whole) - 1
        batch['inputs'][row, :n], batch['targets'][row, :n] = whole[:-1], whole[1:]
        batch['mask'][row, max(n - len(continuation), 0):n] = 1.0
      out = self._run(batch)
      for row, request in enumerate(chunk):
        answer = (float(out['loglik'][row]), bool(out['greedy'][row]))
        results.append(answer)
        if request[0] is not None:
          self.cache_hook.add_partial('loglikelihood', request[0], answer)
    return results

  def _run(self, batch: dict) -> dict:
    size = self.batch_size
    rows = feed.process_rows(self.setup.batch_sharding, size)
    with self.setup.scope():
      out = self._score(self.params, feed.to_global({k: v[rows] for k, v in batch.items()},
                                                    self.setup.batch_sharding, size))
    return jax.tree.map(np.asarray, out)

  def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
    """Each string's log-likelihood over the harness's rolling windows of max_len tokens
    (the first after the end-of-text token): every token scored once."""
    windows, owners = [], []
    for index, (string,) in enumerate(req.args for req in requests):
      for context, continuation in map(lm_utils.make_disjoint_window,
                                       lm_utils.get_rolling_token_windows(
                                           token_list=self.tok_encode(string),
                                           prefix_token=self.prefix_token_id,
                                           max_seq_len=self.max_length, context_len=1)):
        windows.append((None, context, continuation))
        owners.append(index)
    scores = self._loglikelihood_tokens(windows, disable_tqdm)
    totals = np.zeros(len(requests))
    np.add.at(totals, owners, [s for s, _ in scores])
    for req, total in zip(requests, totals):
      self.cache_hook.add_partial('loglikelihood_rolling', req.args, float(total))
    return [float(t) for t in totals]

  def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
    """Each request's continuation: up to max_gen_toks tokens from the key/value cache,
    cut before the first of its `until` strings (and the end-of-text token)."""
    del disable_tqdm
    results: list[Optional[str]] = [None] * len(requests)
    groups: dict[str, list[int]] = {}
    for index, req in enumerate(requests):
      groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(index)
    for key, indices in groups.items():
      kwargs = json.loads(key)
      until = kwargs.get('until') or []
      until = [until] if isinstance(until, str) else list(until)
      eot = self.tok_decode([self.eot_token_id])
      if eot and eot not in until:
        until.append(eot)
      new = min(int(kwargs.get('max_gen_toks', self.max_gen_toks)), self.max_length - 1)
      temperature = float(kwargs.get('temperature', 0.0)) if kwargs.get('do_sample', False) \
          else 0.0
      for start in range(0, len(indices), self.batch_size):
        chunk = indices[start:start + self.batch_size]
        prompts = [self.tok_encode(requests[i].args[0])[-(self.max_length - new):] or
                   [self.prefix_token_id] for i in chunk]
        texts = self._generate(prompts, new, temperature)
        for i, text in zip(chunk, texts):
          for stop in until:
            if stop:
              text = text.split(stop)[0]
          results[i] = text
          self.cache_hook.add_partial('generate_until', requests[i].args, text)
    return results

  def _generate(self, prompts: list[list[int]], new: int, temperature: float) -> list[str]:
    longest = max(len(p) for p in prompts)
    width = min(-(-longest // PROMPT_BUCKET) * PROMPT_BUCKET, self.max_length - new)
    prompts_BP = np.zeros((self.batch_size, width), np.int32)
    pad_B = np.full(self.batch_size, width - 1, np.int32)  # Rows past the chunk: one token.
    for row, ids in enumerate(prompts):
      prompts_BP[row, width - len(ids):] = ids
      pad_B[row] = width - len(ids)
    if (width, new, temperature) not in self._generators:
      replicated = jax.sharding.NamedSharding(self.setup.mesh, jax.sharding.PartitionSpec())
      self._generators[(width, new, temperature)] = jax.jit(functools.partial(
          decode.generate_cached, self.setup.model, num_tokens=new, temperature=temperature),
          out_shardings=replicated)
    with self.setup.scope():
      out = np.asarray(self._generators[(width, new, temperature)](
          self.params, prompts_BP, pad_B, rng=jax.random.key(self.seed)))
    texts = []
    for row in range(len(prompts)):
      ids = out[row, width:].tolist()
      if self.eot_token_id in ids:
        ids = ids[:ids.index(self.eot_token_id)]
      texts.append(self.tok_decode(ids))
    return texts


def _task_manager(include_path: str, tasks: tuple[str, ...]) -> Any:
  """An index of the harness's tasks that knows `tasks`: those under `include_path` alone
  when they define every one of them as a task, else those and every task the harness
  ships (reading its 15k task YAML files takes 12 s on a 2-core CPU)."""
  if include_path:
    local = _index(include_path, False)
    if set(tasks) <= set(local.all_subtasks):  # A group may name the harness's tasks.
      return local
  return _index(include_path, True)


@functools.lru_cache(maxsize=4)
def _index(include_path: str, defaults: bool) -> Any:
  """The harness's TaskManager: built once per process."""
  from lm_eval.tasks import TaskManager  # pylint: disable=import-outside-toplevel
  return TaskManager(include_path=include_path or None, include_defaults=defaults)


def evaluate(workdir: str, tasks: list[str], include_path: str = '', limit: Optional[float] = None,
             num_fewshot: Optional[int] = None, batch_size: int = 16, mesh_shape: str = '',
             max_gen_toks: int = 256, seed: int = 0, log_samples: bool = False) -> dict:
  """lm_eval.simple_evaluate of `tasks` (names, or tasks defined in YAML files under
  `include_path`) on the run in `workdir`; the harness's results dict."""
  import lm_eval  # pylint: disable=import-outside-toplevel
  if include_path and not os.path.isdir(include_path):
    raise ConfigError(f'--include_path: {include_path} is not a directory; give the directory '
                      'of your task YAML files')
  manager = _task_manager(os.path.abspath(include_path) if include_path else '', tuple(tasks))
  unknown = [t for t in tasks if t not in manager.all_tasks]
  if unknown:
    raise ConfigError(f'--tasks: unknown {", ".join(unknown)}, among the harness\'s tasks and '
                      f'those under --include_path={include_path!r}; give their names')
  model = ZooLM(workdir, batch_size=batch_size, mesh_shape=mesh_shape,
                max_gen_toks=max_gen_toks, seed=seed)
  try:
    return lm_eval.simple_evaluate(model=model, tasks=tasks, task_manager=manager, limit=limit,
                                   num_fewshot=num_fewshot, log_samples=log_samples,
                                   random_seed=seed, numpy_random_seed=seed,
                                   torch_random_seed=seed, fewshot_random_seed=seed)
  except ValueError as e:  # The harness's few-shot sampler, drawing more than a task has.
    if num_fewshot and 'larger than population' in str(e):
      raise ConfigError(f'--num_fewshot: {num_fewshot} is more examples than a task has to draw '
                        'them from; give fewer') from None
    raise


def summary(results: dict) -> dict[str, Any]:
  """task -> its metrics (numbers only), from the harness's results."""
  return {task: {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
          for task, metrics in results.get('results', {}).items()}
