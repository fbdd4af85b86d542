"""DPO (experiments/dpo_lm.py; zoo.run.tasks.Preference, zoo.data.preference,
zoo.run.reference) on a tiny random Qwen2 imported from transformers: the loss, TRL's
figures and the gradients equal TRL 1.16's own `DPOTrainer._compute_loss` (sigmoid, IPO;
cDPO's label smoothing by its formula, which TRL's sigmoid ignores), the loss is the same
on every mesh, a run computes the reference once and its held-out margin and accuracy rise,
a stopped run resumes on another mesh as if never stopped, and bad pairs are one line."""
import json
import os
import pathlib

import jax
import numpy as np
import pytest

from conftest import Trainer, experiment, imported_state, read_metrics, stop_at
from zoo.data import writer
from zoo.errors import ConfigError
from zoo.hf import layouts, transfer
from zoo.run import config as cfg
from zoo.run import reference, steps, train
from zoo.store import checkpoint

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')
trl = pytest.importorskip('trl')

def _pairs(n, seed=0):
  """Prompts of digits; the chosen completion sorts them, the rejected one reverses them."""
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(n):
    digits = [str(d) for d in rng.integers(0, 10, size=int(rng.integers(3, 7)))]
    rows.append({'prompt': 'sort ' + ' '.join(digits) + ':',
                 'chosen': ' ' + ' '.join(sorted(digits)),
                 'rejected': ' ' + ' '.join(digits[::-1])})
  return rows


@pytest.fixture(scope='module')
def qwen(qwen_import, tmp_path_factory):
  """The tiny Qwen2 imported into zoo (conftest.QWEN), and 160 sorting pairs prepared with
  its tokenizer (zoo.prepare preference, in process)."""
  root = tmp_path_factory.mktemp('dpo')
  pairs = root / 'pairs.jsonl'
  pairs.write_text(''.join(json.dumps(r) + '\n' for r in _pairs(160)))
  data = str(root / 'pairs')
  writer.run('preference', writer.Options(inputs=(str(pairs),), output=data, val_fraction=0.2,
                                          tokenizer=qwen_import['workdir']))
  return {**qwen_import, 'data': data, 'root': root}


def _config(qwen, variant=',smoke', **overrides):
  c = cfg.load_experiment(experiment('dpo_lm'), qwen['workdir'] + variant)
  c.data.path, c.mesh.shape = qwen['data'], (4, 2)
  c.train.log_every_steps, c.checkpoint.async_save = 1, False
  for key, value in overrides.items():
    group, name = key.split('.')
    c[group][name] = value
  return c


def _imported(trainer, qwen):
  return imported_state(trainer, qwen['workdir'])


def _batch(trainer, size=4):
  """A train batch whose reference log-probs differ from the policy's, so that every term of
  the loss is away from its value at the start."""
  batch = trainer.dataset.train_batch(0, size, slice(0, size))
  offsets = np.random.default_rng(1).normal(0, 2, (size, 2)).astype(np.float32)
  return dict(batch, reference=-20.0 + offsets)


def _zoo(trainer, state, batch):
  """(loss, figures, the gradient as Hugging Face tensors)."""
  task = trainer.setup.task
  def objective(params):
    value, (_, figures) = steps.loss(params, state, batch, jax.random.key(0), task,
                                     task.counted(batch))
    return value, figures
  with trainer.scope():
    (value, figures), grads = jax.jit(jax.value_and_grad(objective, has_aux=True))(state.params)
  flat = transfer._unscanned(transfer._flat(jax.device_get(grads)))  # pylint: disable=protected-access
  return float(value), {k: float(v) for k, v in figures.items()}, flat


def _trl(qwen, batch, loss, beta):
  """TRL's loss, figures and gradients (by Hugging Face name) for the same pairs."""
  from datasets import Dataset  # pylint: disable=import-outside-toplevel
  tokenizer = transformers.PreTrainedTokenizerFast(
      tokenizer_file=os.path.join(qwen['hf'], 'tokenizer.json'), eos_token='<|endoftext|>',
      pad_token='<|endoftext|>')
  model = transformers.Qwen2ForCausalLM.from_pretrained(qwen['hf'], dtype=torch.float32)
  args = trl.DPOConfig(output_dir=str(qwen['root'] / 'trl'), bf16=False, report_to=[],
                       beta=beta, loss_type=[loss], precompute_ref_log_probs=True,
                       use_cpu=True, max_length=None)
  pairs = Dataset.from_list(_pairs(2))
  trainer = trl.DPOTrainer(model=model, args=args, train_dataset=pairs, processing_class=tokenizer)
  tokens = np.concatenate([batch['inputs'][..., :1], batch['targets']], -1)   # [B, 2, L + 1]
  completion = np.concatenate([np.zeros_like(batch['mask'][..., :1]), batch['mask']], -1)
  last = completion.shape[-1] - 1 - np.argmax(completion[..., ::-1], -1)      # [B, 2]
  attention = np.arange(completion.shape[-1]) <= last[..., None]
  rows = lambda x: torch.tensor(np.concatenate([x[:, 0], x[:, 1]]).astype(np.int64))
  inputs = {'input_ids': rows(tokens), 'attention_mask': rows(attention),
            'completion_mask': rows(completion),
            'ref_chosen_logps': torch.tensor(batch['reference'][:, 0]),
            'ref_rejected_logps': torch.tensor(batch['reference'][:, 1])}
  trainer.model.train()
  value = trainer._compute_loss(trainer.model, inputs, return_outputs=False)  # pylint: disable=protected-access
  value.backward()
  figures = {k: v[-1] for k, v in trainer._metrics['train'].items()}  # pylint: disable=protected-access
  grads = {name: p.grad.numpy() for name, p in trainer.model.named_parameters()}
  return float(value), figures, grads


FIGURES = ('rewards/chosen', 'rewards/rejected', 'rewards/margins', 'rewards/accuracies',
           'logps/chosen', 'logps/rejected')


@pytest.mark.parametrize('loss', ['sigmoid', 'ipo'])
def test_loss_figures_and_gradients_equal_trls(qwen, loss, devices):
  del devices
  trainer = Trainer(_config(qwen, **{'dpo.loss': loss, 'dpo.beta': 0.5, 'mesh.shape': (8, 1)}))
  state, batch = _imported(trainer, qwen), _batch(trainer)
  value, figures, grads = _zoo(trainer, state, batch)
  want_value, want_figures, want_grads = _trl(qwen, batch, loss, beta=0.5)
  assert value == pytest.approx(want_value, abs=1e-5)
  for name in FIGURES:
    assert figures[name] == pytest.approx(want_figures[name], abs=1e-5), name
  assert 0 < figures['rewards/accuracies'] < 1  # Both signs: the figures are not trivial.
  hf_config = json.loads((pathlib.Path(qwen['hf']) / 'config.json').read_text())
  _, arch = layouts.architecture(hf_config)
  checked = 0
  for tensor in arch.tensors(arch.from_hf(hf_config)):
    got = tensor.to_hf(*[grads[p] for p in tensor.zoo])
    want = want_grads[tensor.name]
    scale = np.abs(want).max()
    assert scale > 0, tensor.name
    np.testing.assert_allclose(got, want, atol=1e-4 * scale, rtol=0, err_msg=tensor.name)
    checked += 1
  assert checked == len(want_grads)


def test_label_smoothing_is_conservative_dpo(qwen, devices):
  """cDPO: -(1 - s) log sigmoid(m) - s log sigmoid(-m) per pair, m the reward margin."""
  del devices
  trainer = Trainer(_config(qwen, **{'dpo.label_smoothing': 0.2, 'mesh.shape': (8, 1)}))
  state, batch = _imported(trainer, qwen), _batch(trainer)
  task = trainer.setup.task
  with trainer.scope():
    out = state.apply_fn({'params': state.params}, *task.model_inputs(batch),
                         **task.model_keywords(batch))
    pairs = jax.device_get(task.pairs(out, batch))
  m = pairs['rewards/margins']
  log_sigmoid = lambda x: -np.logaddexp(0.0, -x)
  np.testing.assert_allclose(pairs['loss'], -0.8 * log_sigmoid(m) - 0.2 * log_sigmoid(-m),
                             rtol=1e-5)


def test_the_loss_and_figures_are_the_same_on_every_mesh(qwen, devices):
  rows = []
  for shape, chips in (((1, 1), devices[:1]), ((8, 1), None), ((4, 2), None), ((2, 4), None)):
    trainer = Trainer(_config(qwen, **{'mesh.shape': shape, 'train.batch_size': 8}),
                      devices=chips)
    with trainer.scope():
      _, metrics = trainer.train_step(_imported(trainer, qwen), _batch(trainer, 8))
    rows.append({k: float(v) for k, v in metrics.items() if k != 'train/grad_norm'})
    rows[-1]['grad_norm'] = float(metrics['train/grad_norm'])
  for row in rows[1:]:
    assert row == pytest.approx(rows[0], rel=1e-5, abs=1e-6)


@pytest.fixture(scope='module')
def tuned(qwen, tmp_path_factory):
  """The smoke DPO run, straight through on mesh (4, 2)."""
  workdir = str(tmp_path_factory.mktemp('dpo_run'))
  train.train_and_evaluate(_config(qwen), workdir)
  return workdir


def test_a_run_scores_the_reference_once_and_its_held_out_margin_rises(qwen, tuned, devices):
  del devices
  rows = read_metrics(tuned)
  table = json.loads(open(os.path.join(tuned, reference.FILE), encoding='utf-8').read())
  meta = json.loads(open(os.path.join(qwen['data'], 'metadata.json'), encoding='utf-8').read())
  assert {k: len(v) for k, v in table.items()} == {
      k: meta['splits'][k]['pairs'] for k in ('train', 'val')}
  first = next(r for r in rows if 'train/loss' in r)
  assert first['train/loss'] == pytest.approx(np.log(2), abs=1e-3)  # Policy = reference.
  for name in FIGURES:
    assert f'train/{name}' in first and f'eval/{name}' in rows[-1]
  evals = [r for r in rows if 'eval/loss' in r]
  assert evals[-1]['eval/rewards/margins'] > evals[0]['eval/rewards/margins'] > 0
  assert evals[-1]['eval/rewards/accuracies'] > 0.5
  assert evals[-1]['eval/loss'] < np.log(2)


def test_a_stopped_run_resumes_on_another_mesh_as_if_never_stopped(qwen, tuned, tmp_path,
                                                                    monkeypatch, devices):
  del devices
  workdir = str(tmp_path / 'resumed')
  stop_at(monkeypatch, 3)  # Not an eval step: the stopped run saves and exits before one.
  train.train_and_evaluate(_config(qwen), workdir)
  monkeypatch.undo()
  train.train_and_evaluate(_config(qwen, **{'mesh.shape': (8, 1)}), workdir)
  strip = lambda d: [{k: v for k, v in r.items() if not k.startswith('perf/')}
                     for r in read_metrics(d)]
  got, want = strip(workdir), strip(tuned)
  assert [r['step'] for r in got] == [r['step'] for r in want]
  for row, ref in zip(got, want):
    assert row == pytest.approx(ref, rel=2e-5), (row, ref)


@pytest.mark.parametrize('line, message', [
    ({'prompt': 'a', 'chosen': 'b'}, 'line 2: a pair needs "prompt", "chosen" and "rejected"'),
    ({'prompt': 'a', 'chosen': 'b', 'rejected': ' '}, 'line 2: "rejected" is an empty completion'),
    ({'prompt': 'a', 'chosen': 3, 'rejected': 'c'}, 'line 2: "chosen" must be a string'),
])
def test_bad_pairs_are_one_line_naming_the_file_and_line(qwen, tmp_path, line, message):
  pairs = tmp_path / 'bad.jsonl'
  pairs.write_text(json.dumps(_pairs(1)[0]) + '\n' + json.dumps(line) + '\n')
  with pytest.raises(ConfigError, match=message) as e:
    writer.run('preference', writer.Options(inputs=(str(pairs),), output=str(tmp_path / 'out'),
                                            tokenizer=qwen['workdir']))
  assert str(pairs) in str(e.value) and '\n' not in str(e.value)
  assert not os.path.exists(tmp_path / 'out')


def test_every_kind_of_prepare_takes_the_models_directory(qwen, tuned, tmp_path):
  """`--tokenizer` of `text` (like `chat` and `preference`): a Hugging Face model's
  directory, the zoo workdir it was imported into, or a zoo run's (its data's tokenizer)."""
  docs = tmp_path / 'docs.jsonl'
  docs.write_text(''.join(json.dumps({'text': f'document {i}'}) + '\n' for i in range(20)))
  for i, directory in enumerate((qwen['hf'], qwen['workdir'], tuned)):
    out = tmp_path / f'out{i}'
    writer.run('text', writer.Options(inputs=(str(docs),), output=str(out), val_fraction=0.2,
                                      tokenizer=directory))
    assert json.loads((out / 'metadata.json').read_text())['vocab_size'] == 257


def test_conversational_pairs_train_on_what_the_template_adds_for_each_completion(qwen, tmp_path):
  """TRL's conversational format: the prompt rendered with the generation prompt, each
  completion as the rest of the conversation the template renders (the mask covers it)."""
  from zoo.data import preference  # pylint: disable=import-outside-toplevel
  template = os.path.join(os.path.dirname(preference.__file__), 'templates',
                          'question_answer.jinja')
  pairs = tmp_path / 'chat.jsonl'
  pairs.write_text(''.join(json.dumps({
      'prompt': [{'role': 'user', 'content': f'sort {i} 1'}],
      'chosen': [{'role': 'assistant', 'content': f'1 {i}'}],
      'rejected': [{'role': 'assistant', 'content': f'{i} 1'}]}) + '\n' for i in range(2, 9)))
  out = str(tmp_path / 'out')
  writer.run('preference', writer.Options(inputs=(str(pairs),), output=out, val_fraction=0.3,
                                          tokenizer=qwen['workdir'], chat_template=template))
  config = _config(qwen)
  config.data.path = out
  from zoo import data  # pylint: disable=import-outside-toplevel
  dataset = data.load(config.data, 0)
  batch = dataset.train_batch(0, 1, slice(0, 1))
  for row, want in ((0, '1 {d}\n'), (1, '{d} 1\n')):  # trim_blocks eats one newline.
    mask = batch['mask'][0, row].astype(bool)
    prompt = dataset.decode(batch['inputs'][0, row][:np.argmax(mask) + 1])
    digit = prompt.split('sort ')[1][0]
    assert prompt == f'### Question:\nsort {digit} 1\n\n### Answer:\n'
    assert dataset.decode(batch['targets'][0, row][mask]) == want.format(d=digit)


def test_under_lora_the_reference_is_the_base_and_only_adapters_train(qwen, tmp_path, devices):
  """`,lora`: the reference scores are the base model's (the adapters start at zero), so the
  first step's loss is log 2, and the base weights are left as imported."""
  del devices
  workdir = str(tmp_path / 'lora')
  config = _config(qwen, ',smoke,lora', **{'train.steps': 4, 'checkpoint.every_steps': 4,
                                          'eval.every_steps': 4})
  train.train_and_evaluate(config, workdir)
  rows = [r for r in read_metrics(workdir) if 'train/loss' in r]
  assert rows[0]['train/loss'] == pytest.approx(np.log(2), abs=1e-5)
  for name in ('chosen', 'rejected'):  # beta x (policy - reference): 0 at the start.
    assert abs(rows[0][f'train/rewards/{name}']) < 1e-5, rows[0]
  assert rows[-1]['train/loss'] < rows[0]['train/loss']
  flat = {}
  for source, settings in ((workdir, config), (qwen['workdir'], _config(qwen))):
    trainer = Trainer(settings)
    with trainer.scope():
      params, _, _ = checkpoint.restore_params(source, trainer.setup.abstract_state().params)
    flat[source] = {jax.tree_util.keystr(k): v for k, v in
                    jax.tree_util.tree_flatten_with_path(jax.device_get(params))[0]}
  base = flat[qwen['workdir']]
  assert set(base) < set(flat[workdir])  # The run has adapters besides.
  for key, value in base.items():
    np.testing.assert_array_equal(flat[workdir][key], value, err_msg=key)
