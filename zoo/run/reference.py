"""The reference model's figures that a dataset's batches carry (DPO: each completion's
log-probability under the frozen starting model), computed once per run.

The reference is the state a run starts from: `checkpoint.init_from`'s parameters, or with
LoRA the base model (its adapters start at zero, so the starting model is the base: no
second copy of the weights is ever held). A fresh run scores every training and held-out
pair with it before its first step, in batches of eval.batch_size over the mesh, and
process 0 writes the tables to the workdir (`reference.json`, complete or absent); a
resumed run reads them back, so it carries the same figures on any mesh or process count.
"""
import json
import math
import time

from absl import logging
import jax
import numpy as np

from zoo.data import feed
from zoo.errors import CheckpointError
from zoo.run import setup as setup_lib
from zoo.run import steps, tasks
from zoo.store.workdir import Workdir

FILE = 'reference.json'


def _score(params, batch, apply_fn):
  """Each completion's log-probability of its masked targets, [B, 2]."""
  rows = {k: v.reshape((-1,) + v.shape[2:]) for k, v in batch.items() if k != 'weights'}
  out = steps.score_step(params, rows, apply_fn, tasks.TASKS['lm'])
  return out['loglik'].reshape(batch['mask'].shape[:2])


def compute(setup: setup_lib.Setup, params) -> dict:
  """{split: [N, 2] float32}: the dataset's examples scored by the model with `params`."""
  replicated = jax.sharding.NamedSharding(setup.mesh, jax.sharding.PartitionSpec())
  score = setup.jit(_score, apply_fn=setup.model.apply,
                    in_shardings=(setup.state_shardings.params, setup.batch_sharding),
                    out_shardings=replicated)
  size, reference = setup.config.eval.batch_size, setup.dataset.reference
  tables = {}
  for split, batches in reference.batches.items():
    n = len(reference.tables[split])
    t0 = time.perf_counter()
    parts = [np.asarray(score(params, batch))
             for batch in feed.eval_batches(batches, setup.batch_sharding, size)]
    tables[split] = np.concatenate(parts)[:n].astype(np.float32)
    logging.info('reference: scored %d %s examples in %.1f s (%d batches of %d)', n, split,
                 time.perf_counter() - t0, math.ceil(n / size), size)
  return tables


def attach(setup: setup_lib.Setup, state: steps.TrainState, workdir: Workdir) -> None:
  """Fills the dataset's reference tables: scored with `state` (a fresh run's, at step 0)
  and written to the workdir by process 0, or read back from it (a resumed run)."""
  reference = setup.dataset.reference
  if int(state.step) == 0:
    tables = compute(setup, state.params)
    if jax.process_index() == 0:
      workdir.write_text(FILE, json.dumps({k: v.tolist() for k, v in tables.items()}))
  elif workdir.has(FILE):
    tables = {k: np.asarray(v, np.float32) for k, v in workdir.read_json(FILE).items()}
  else:
    raise CheckpointError(f'--workdir: {workdir} has checkpoints past step 0 but no {FILE} (the '
                          'reference model\'s log-probabilities, written before the first step); '
                          'start the run again in a new workdir')
  for split, table in tables.items():
    if table.shape != reference.tables[split].shape:
      raise CheckpointError(f'--workdir: {workdir.join(FILE)} holds {table.shape[0]} {split} '
                            f'examples, the data {reference.tables[split].shape[0]}: the run '
                            'started on other data; give its data.path or a new workdir')
    reference.tables[split][...] = table
