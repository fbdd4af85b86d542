"""GRPO (experiments/grpo_sort.py; zoo.run.rollouts, zoo.run.tasks.PolicyGradient,
zoo.data.prompts, zoo.data.rewards) on a tiny random Qwen2 imported from transformers: the
loss, its figures and the gradients equal TRL 1.16's own `GRPOTrainer._compute_loss` for
every aggregation, on-policy and with old log-probabilities that make the clip bite, at a
temperature other than 1 and with beta > 0, and the advantages its formula; the loss is
the same on every mesh; a run learns where the reward says and not where it is shuffled;
a stopped run resumes on 2 processes and another mesh as if never stopped; bad rewards and
budgets are one line."""
import json
import os
import pathlib
import re

import jax
import numpy as np
import pytest

from conftest import QWEN, Trainer, experiment, imported_state, read_metrics, stop_at
from zoo.data import writer
from zoo.errors import ConfigError, ZooError
from zoo.hf import layouts, transfer
from zoo.run import config as cfg
from zoo.run import rollouts, steps, train

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')
trl = pytest.importorskip('trl')

N = 6  # Completion tokens in the numerics tests.


@pytest.fixture(scope='module')
def qwen(qwen_import, tmp_path_factory):
  """The tiny Qwen2 imported into zoo (conftest.QWEN), and sorting prompts prepared with
  its tokenizer."""
  from zoo.data import sorting  # pylint: disable=import-outside-toplevel
  root = tmp_path_factory.mktemp('grpo')
  sorting.write(str(root / 'sort'), sft=10, pairs=10, prompts=120)
  data = str(root / 'prompts')
  writer.run('prompts', writer.Options(inputs=(str(root / 'sort' / 'prompts.jsonl'),),
                                       output=data, val_fraction=0.2,
                                       tokenizer=qwen_import['workdir']))
  return {**qwen_import, 'data': data, 'root': root}


def _config(qwen, variant=',smoke', **overrides):
  c = cfg.load_experiment(experiment('grpo_sort'), qwen['workdir'] + variant)
  c.data.path, c.mesh.shape = qwen['data'], (4, 2)
  c.train.log_every_steps, c.checkpoint.async_save = 1, False
  for key, value in overrides.items():
    group, name = key.split('.')
    c[group][name] = value
  return c


def _imported(trainer, qwen):
  return imported_state(trainer, qwen['workdir'])


def _rollout(trainer, rows=8, seed=0):
  """A batch of `rows` completions of N tokens (random, of random lengths) after the data's
  prompts (left-padded, of different lengths), with random advantages."""
  rng = np.random.default_rng(seed)
  prompts = trainer.dataset.train_batch(0, rows, slice(0, rows))
  lengths = rng.integers(2, N + 1, rows)
  tokens = np.where(np.arange(N) < lengths[:, None], rng.integers(40, 60, (rows, N)), 0)
  batch = rollouts.train_rows(prompts['prompt'], prompts['pad'], tokens, lengths)
  batch['advantages'] = rng.normal(0, 1, rows).astype(np.float32)
  return batch, prompts, tokens, lengths


def _zoo(trainer, state, batch):
  """(loss, figures, gradient by zoo path)."""
  task = trainer.setup.task
  def objective(params):
    value, (_, figures) = steps.loss(params, state, batch, jax.random.key(0), task,
                                     task.counted(batch), task.figure_total(batch))
    return value, figures
  with trainer.scope():
    (value, figures), grads = jax.jit(jax.value_and_grad(objective, has_aux=True))(state.params)
  flat = transfer._unscanned(transfer._flat(jax.device_get(grads)))  # pylint: disable=protected-access
  return float(value), {k: float(v) for k, v in figures.items()}, flat


def _logps(trainer, state, batch):
  """zoo's log-probabilities of the batch's targets at the task's temperature."""
  task = trainer.setup.task
  with trainer.scope():
    out = jax.jit(lambda p: state.apply_fn({'params': p}, *task.model_inputs(batch),
                                           **task.model_keywords(batch)))(state.params)
  return -np.asarray(out['loss']) * batch['mask']


def _trl(qwen, grpo, prompts, tokens, lengths, batch):
  """TRL's loss, figures and gradients (by Hugging Face name) for the same completions."""
  from datasets import Dataset  # pylint: disable=import-outside-toplevel
  tokenizer = transformers.PreTrainedTokenizerFast(
      tokenizer_file=os.path.join(qwen['hf'], 'tokenizer.json'), eos_token='<|endoftext|>',
      pad_token='<|endoftext|>')
  def zero(completions, **unused):
    del unused
    return [0.0] * len(completions)
  args = trl.GRPOConfig(
      output_dir=str(qwen['root'] / 'trl'), bf16=False, report_to=[], use_cpu=True,
      per_device_train_batch_size=len(lengths), num_generations=4, max_completion_length=N,
      beta=grpo.beta, loss_type=grpo.loss, epsilon=grpo.epsilon,
      epsilon_high=grpo.epsilon_high or grpo.epsilon, temperature=grpo.temperature,
      importance_sampling_level=grpo.importance)
  trainer = trl.GRPOTrainer(model=qwen['hf'], reward_funcs=[zero], args=args,
                            train_dataset=Dataset.from_list([{'prompt': 'a'}] * 8),
                            processing_class=tokenizer)
  width = prompts['prompt'].shape[1]
  completion = (np.arange(N) < lengths[:, None])
  inputs = {'prompt_ids': torch.tensor(prompts['prompt'].astype(np.int64)),
            'prompt_mask': torch.tensor((np.arange(width) >= prompts['pad'][:, None]).astype(
                np.int64)),
            'completion_ids': torch.tensor(tokens.astype(np.int64)),
            'completion_mask': torch.tensor(completion.astype(np.int64)),
            'advantages': torch.tensor(batch['advantages']),
            'num_items_in_batch': torch.tensor(float(completion.sum()))}
  for zoo_name, trl_name in (('old_logps', 'old_per_token_logps'),
                             ('ref_logps', 'ref_per_token_logps')):
    if zoo_name in batch:  # Target P - 1 + j is completion token j.
      inputs[trl_name] = torch.tensor(batch[zoo_name][:, width - 1:])
  trainer.model.train()
  trainer.current_gradient_accumulation_steps = 1  # What its training loop sets: one step.
  value = trainer._compute_loss(trainer.model, inputs)  # pylint: disable=protected-access
  value.backward()
  figures = {k: v[-1] for k, v in trainer._metrics['train'].items()}  # pylint: disable=protected-access
  grads = {name: p.grad.numpy() for name, p in trainer.model.named_parameters()}
  return float(value.detach()), figures, grads


CASES = {  # name: (grpo overrides, old log-probs away from the policy's, reference offsets)
    'dapo-on-policy': ({'loss': 'dapo'}, False, False),
    'bnpo-clip-kl-temperature': ({'loss': 'bnpo', 'beta': 0.1, 'temperature': 0.7}, True, True),
    'grpo-clip-higher-kl': ({'loss': 'grpo', 'beta': 0.05, 'epsilon_high': 0.28}, True, True),
    'dr_grpo-clip': ({'loss': 'dr_grpo', 'temperature': 1.3}, True, False),
    'gspo-sequence': ({'loss': 'dapo', 'importance': 'sequence', 'epsilon': 0.0003,
                       'epsilon_high': 0.0004}, True, False),
}


@pytest.mark.parametrize('case', list(CASES))
def test_loss_figures_and_gradients_equal_trls(qwen, case, devices):
  del devices
  overrides, old, ref = CASES[case]
  grpo = {'grpo.max_completion_tokens': N, 'mesh.shape': (8, 1), 'grpo.beta': 0.0,
          'grpo.num_iterations': 2 if old else 1, 'checkpoint.every_steps': 2,
          'eval.every_steps': 2, **{f'grpo.{k}': v for k, v in overrides.items()}}
  trainer = Trainer(_config(qwen, **grpo))
  state = _imported(trainer, qwen)
  batch, prompts, tokens, lengths = _rollout(trainer)
  rng = np.random.default_rng(1)
  logps = _logps(trainer, state, batch)
  if old:  # Ratios of exp(+-0.5): the clip bites on both sides.
    batch['old_logps'] = (logps + rng.uniform(-0.5, 0.5, logps.shape) * batch['mask']
                          ).astype(np.float32)
  if ref:
    batch['ref_logps'] = (logps + rng.normal(0, 0.5, logps.shape) * batch['mask']
                          ).astype(np.float32)
  value, figures, grads = _zoo(trainer, state, batch)
  want_value, want_figures, want_grads = _trl(qwen, trainer.config.grpo, prompts, tokens,
                                              lengths, batch)
  assert value == pytest.approx(want_value, abs=1e-5), (value, want_value)
  assert figures['entropy'] == pytest.approx(want_figures['entropy'], rel=1e-5)
  if ref:
    assert figures['kl'] == pytest.approx(want_figures['kl'], rel=1e-5)
  if trainer.config.grpo.importance == 'token':
    for name in ('low', 'high', 'region'):
      assert figures[f'clip_ratio/{name}'] == pytest.approx(
          want_figures[f'clip_ratio/{name}_mean'], abs=1e-6), name
    if old:
      assert 0 < figures['clip_ratio/low'] and 0 < figures['clip_ratio/high']
  hf_config = json.loads((pathlib.Path(qwen['hf']) / 'config.json').read_text())
  _, arch = layouts.architecture(hf_config)
  for tensor in arch.tensors(arch.from_hf(hf_config)):
    got, want = tensor.to_hf(*[grads[p] for p in tensor.zoo]), want_grads[tensor.name]
    np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max(), rtol=0,
                               err_msg=tensor.name)


def test_advantages_are_trls(monkeypatch):
  """zoo's advantages (numpy) against TRL's formula on its own nanstd, for every scaling,
  with an unscorable completion (NaN) and a group of equal rewards."""
  from trl.trainer.utils import nanstd  # pylint: disable=import-outside-toplevel
  del monkeypatch
  rewards = np.array([1.0, 0.0, 0.5, np.nan, 2.0, 2.0, 2.0, 2.0, 0.3, 0.1, 0.9, 0.4])
  t = torch.tensor(rewards)
  mean = torch.nanmean(t.view(-1, 4), dim=1).repeat_interleave(4)
  for scale in ('group', 'batch', 'none'):
    std = (nanstd(t.view(-1, 4), dim=1).repeat_interleave(4) if scale != 'batch' else
           nanstd(t).expand_as(t))
    want = t - mean
    if scale != 'none':
      want = want / (std + 1e-4)
    want = torch.nan_to_num(want, nan=0.0).numpy()
    np.testing.assert_allclose(rollouts.advantages(rewards, 4, scale), want, rtol=1e-6,
                               atol=1e-7, err_msg=scale)


def test_the_loss_and_figures_are_the_same_on_every_mesh(qwen, devices):
  rows = []
  for shape, chips in (((1, 1), devices[:1]), ((8, 1), None), ((4, 2), None), ((2, 4), None)):
    trainer = Trainer(_config(qwen, **{'mesh.shape': shape, 'grpo.beta': 0.1,
                                       'grpo.max_completion_tokens': N}), devices=chips)
    state = _imported(trainer, qwen)
    batch, *_ = _rollout(trainer, rows=16)
    logps = _logps(trainer, state, batch)
    batch['ref_logps'] = (logps + 0.1 * batch['mask']).astype(np.float32)
    with trainer.scope():
      _, metrics = trainer.train_step(state, batch)
    rows.append({k: float(v) for k, v in metrics.items()})
  for row in rows[1:]:
    assert row == pytest.approx(rows[0], rel=1e-5, abs=1e-6)


def _run_config(qwen, reward, variant=',smoke', **overrides):
  return _config(qwen, variant, **{
      'grpo.rewards': (f'grpo_rewards:{reward}',), 'grpo.reward_weights': (), 'grpo.beta': 0.05,
      'grpo.max_completion_tokens': N, 'train.steps': 12, 'optimizer.learning_rate': 3e-2,
      'optimizer.warmup_steps': 0, 'eval.every_steps': 12, 'checkpoint.every_steps': 4,
      **overrides})


@pytest.fixture(scope='module')
def learned(qwen, tmp_path_factory):
  """12 steps on low_ids, straight through on mesh (4, 2), with a KL term (beta 0.05)."""
  workdir = str(tmp_path_factory.mktemp('grpo_run'))
  train.train_and_evaluate(_run_config(qwen, 'low_ids'), workdir)
  return workdir


def _rewards(workdir):
  return [r['train/reward'] for r in read_metrics(workdir) if 'train/reward' in r]


def test_a_run_learns_its_reward_and_not_a_shuffled_one(qwen, learned, tmp_path, devices):
  """The cheap guard against sign and normalisation bugs: the same run with the rewards
  shuffled among the completions does not improve."""
  del devices
  got = _rewards(learned)
  assert np.mean(got[-3:]) > np.mean(got[:3]) + 0.15, got
  train.train_and_evaluate(_run_config(qwen, 'shuffled_low_ids'), str(tmp_path / 'control'))
  control = _rewards(str(tmp_path / 'control'))
  assert np.mean(control[-3:]) < np.mean(control[:3]) + 0.05, control
  rows = read_metrics(learned)
  for key in ('train/kl', 'train/entropy', 'train/clip_ratio/region', 'train/reward_std',
              'train/rewards/low_ids/mean', 'train/completions/mean_length',
              'train/completions/truncated', 'perf/rollout_tokens_per_s'):
    assert key in rows[0], key
  assert 'eval/greedy/low_ids' in rows[-1] and 'eval/sampled/low_ids' in rows[-1]


def test_a_lora_run_exports_a_peft_adapter_that_peft_loads_with_zoos_logits(qwen, tmp_path,
                                                                           devices):
  """GRPO training rank-8 adapters on the imported Qwen2: `zoo.convert export --peft` writes
  an adapter directory that peft loads onto the transformers original, giving the tuned
  zoo model's logits."""
  del devices
  peft = pytest.importorskip('peft')
  from zoo.hf import transfer as hf_transfer  # pylint: disable=import-outside-toplevel
  workdir, adapter = str(tmp_path / 'run'), str(tmp_path / 'adapter')
  config = _run_config(qwen, 'low_ids', ',smoke,lora', **{'train.steps': 4})
  train.train_and_evaluate(config, workdir)
  trainer = Trainer(config)
  x = np.random.default_rng(0).integers(0, QWEN['vocab_size'], (2, 10)).astype(np.int32)
  with trainer.scope():
    logits = jax.jit(lambda p, x: trainer.model.apply({'params': p}, x))
    want = np.asarray(logits(imported_state(trainer, workdir).params, x))[..., :QWEN['vocab_size']]
  base = transformers.Qwen2ForCausalLM.from_pretrained(qwen['hf']).eval()
  with torch.no_grad():
    start = base(torch.tensor(x, dtype=torch.long)).logits.numpy()
  assert np.abs(want - start).max() > 1e-3  # The adapters learned something.
  hf_transfer.export_model(workdir, adapter, peft=True)
  tuned = peft.PeftModel.from_pretrained(base, adapter).eval()
  with torch.no_grad():
    got = tuned(torch.tensor(x, dtype=torch.long)).logits.numpy()
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize('reward, message', [
    ('raises', r"reward grpo_rewards:raises raised RuntimeError: no sevens \(on the completion "
               r"'.*7.*' of prompt 'sort"),
    ('nan', r"reward grpo_rewards:nan returned nan for the completion '.*' of prompt 'sort"),
    ('short', r'reward grpo_rewards:short returned 15 values for 16 completions'),
])
def test_a_failing_reward_ends_the_run_in_one_line_naming_it_and_the_prompt(
    qwen, tmp_path, reward, message, devices):
  del devices
  with pytest.raises(ZooError, match=message) as e:
    train.train_and_evaluate(_run_config(qwen, reward), str(tmp_path / 'run'))
  assert '\n' not in str(e.value)
  assert not os.path.exists(tmp_path / 'run' / 'checkpoints') or not any(
      d.isdigit() for d in os.listdir(tmp_path / 'run' / 'checkpoints'))


@pytest.mark.parametrize('overrides, field', [
    ({'grpo.max_completion_tokens': 60}, 'grpo.max_completion_tokens'),
    ({'grpo.rewards': ('no_such_module:f',), 'grpo.reward_weights': ()}, 'config.grpo.rewards'),
    ({'grpo.reward_weights': (1.0,)}, 'config.grpo.reward_weights'),
    ({'train.batch_size': 12, 'grpo.num_generations': 8}, 'train.batch_size'),
])
def test_bad_grpo_settings_are_refused_before_anything_is_written(qwen, tmp_path, overrides,
                                                                   field, devices):
  del devices
  with pytest.raises(ConfigError, match=field):
    train.train_and_evaluate(_config(qwen, **overrides), str(tmp_path / 'run'))
  assert not os.path.exists(tmp_path / 'run')


def test_a_stopped_run_resumes_on_two_processes_and_another_mesh_as_if_never_stopped(
    qwen, learned, tmp_path, monkeypatch, devices):
  """`learned`'s run stopped at step 6 (1 process of 8 devices on (4, 2)) resumes on 2
  processes of 4 devices on (8, 1). The policy, optimizer, reference, prompt order and the
  sampler's keys all resume, and the 2 processes sample, score and train as one (each
  scores every completion and feeds its rows): the same prompts, completions, rewards and
  updates, so every logged figure is the straight run's."""
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  from conftest import REPO  # pylint: disable=import-outside-toplevel
  del devices
  workdir = tmp_path / 'resumed'
  config = _run_config(qwen, 'low_ids')
  stop_at(monkeypatch, 6)
  train.train_and_evaluate(config, str(workdir))
  monkeypatch.undo()
  assert _rewards(str(workdir)) == _rewards(learned)[:6]
  flags = {'data.path': qwen['data'], 'mesh.shape': '(8,1)', 'train.log_every_steps': 1,
           'checkpoint.async_save': False, 'grpo.rewards': "('grpo_rewards:low_ids',)",
           'grpo.reward_weights': '()', **{f'{group}.{key}': config[group][key] for group, key in (
               ('grpo', 'beta'), ('grpo', 'max_completion_tokens'), ('train', 'steps'),
               ('optimizer', 'learning_rate'), ('optimizer', 'warmup_steps'),
               ('eval', 'every_steps'), ('checkpoint', 'every_steps'))}}
  result = subprocess.run(
      [sys.executable, os.path.join(REPO, 'launch', 'local.py'), '--processes=2', '--devices=4',
       '--heartbeat_timeout=30', '--', f'--config={experiment("grpo_sort")}:{qwen["workdir"]},smoke',
       *(f'--config.{k}={v}' for k, v in flags.items()), f'--workdir={workdir}'],
      cwd=REPO, capture_output=True, text=True, timeout=240, check=False,
      env={**os.environ, 'PYTHONPATH': os.path.dirname(__file__)})
  assert result.returncode == 0, result.stdout[-3000:]
  assert re.search(r'\[process 1\] .*resuming from step 6', result.stdout), result.stdout[-3000:]
  strip = lambda d: [{k: v for k, v in r.items() if not k.startswith('perf/')}
                     for r in read_metrics(d)]
  got, want = strip(str(workdir)), strip(learned)
  assert [r['step'] for r in got] == [r['step'] for r in want]
  assert want[-2]['train/kl'] > 1e-3  # The reference matters.
  for row, ref in zip(got, want):
    assert row == pytest.approx(ref, rel=1e-4, abs=1e-6), (row, ref)


@pytest.mark.parametrize('variant, reference', [(',smoke', True), (',smoke,lora', False)])
def test_dry_run_counts_the_rollout_its_cache_and_the_reference(qwen, variant, reference,
                                                                devices):
  """--dry_run for GRPO compiles the rollout beside the update and counts what stays on a
  device beside each: the reference parameters throughout (a copy of the parameters with
  beta > 0; none under LoRA, whose reference is the base), and during the rollout the
  optimizer state; the verdict is the largest of those totals against the budget."""
  del devices
  from zoo.run import plan  # pylint: disable=import-outside-toplevel
  c = _config(qwen, variant)
  p = plan.make_plan(c)
  held = p['bytes_per_device']
  assert held['reference'] == (held['params'] if reference else 0)
  rows, prompt = c.train.batch_size, p['rollout']['prompt']
  assert p['rollout']['rows'] == rows and p['rollout']['completion'] == 16
  # Keys and values of 2 layers, 4 heads of 4, prompt + completion slots, float32; the
  # rows split over the 4 batch shards, the heads over the 2 'model' shards.
  cache = 2 * 2 * rows * 4 * (prompt + 16) * 4 * 4
  assert p['rollout']['cache_bytes'] == cache
  assert p['rollout']['cache_per_device'] == cache // 8
  resident = held['optimizer'] + held['model_state'] + held['other']
  assert p['totals'] == {
      'train': p['compiled_memory']['peak'] + held['reference'],
      'eval': p['eval_memory']['peak'] + held['reference'],
      'rollout': p['rollout']['memory']['peak'] + resident + held['reference']}
  text = plan.format_plan(p)
  assert 'rollout (GRPO): 16 rows of' in text
  assert ('reference parameters: none' in text) is not reference
  if reference:  # Just under the largest total: refused, naming its program.
    worst = max(p['totals'], key=p['totals'].get)
    gib = p['totals'][worst] / 2**30 * 0.999
    tight = plan.make_plan(c, gib)
    assert tight['fits'] is False
    assert plan.refusal_line(tight, gib).startswith(f'zoo: the {worst} step needs')
    assert plan.judged(tight, gib / 0.999 * 1.001)['fits'] is True
