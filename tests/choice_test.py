"""Multiple-choice evaluation in the loop (eval.choice_tasks): each choice's log-likelihood
is the model's own, the same on every mesh; acc and acc_norm reach metrics.jsonl at every
eval; bad task files are one line naming file and line; the shipped task is well formed."""
import dataclasses
import json

import jax
import numpy as np
import pytest

from conftest import load_config, read_metrics, trainer
from zoo.data import choice, feed, tokens
from zoo.data import tokenizer as tokenizer_lib
from zoo.errors import ZooError
from zoo.run import setup as setup_lib
from zoo.run import train

SEQ = 32
ITEMS = [
    {'context': 'the cat sat on the ', 'choices': ['mat', 'dog barked loudly', 'x'], 'answer': 0},
    {'context': 'abc abc abc ', 'choices': ['abc', 'xyz'], 'answer': 0},
    {'context': '', 'choices': ['hello world', 'zzzz'], 'answer': 1},
    {'context': 'a long context ' * 4, 'choices': ['that is cut from the left', 'b'], 'answer': 1},
]


@pytest.fixture(scope='module')
def paths(tmp_path_factory):
  root = tmp_path_factory.mktemp('choice')
  (root / 'docs.jsonl').write_text(''.join(
      json.dumps({'text': f'the cat sat on the mat {i} ' * 3}) + '\n' for i in range(40)))
  (root / 'data').mkdir()
  tokens.prepare([str(root / 'docs.jsonl')], str(root / 'data'), tokenizer_lib.bytes_tokenizer(),
                 val_fraction=0.2)
  (root / 'toy.jsonl').write_text(''.join(json.dumps(i) + '\n' for i in ITEMS))
  return {'data': str(root / 'data'), 'task': str(root / 'toy.jsonl')}


def _overrides(paths, **more):
  return {'data.name': 'tokens', 'data.path': paths['data'], 'data.seq_len': SEQ,
          'model.max_len': SEQ, 'model.d_model': 32, 'model.num_heads': 4, 'model.mlp_dim': 64,
          'eval.choice_tasks': (paths['task'],), **more}


def test_the_pair_is_encoded_whole_and_split_after_the_context():
  encode = lambda text: np.frombuffer(text.encode(), np.uint8).astype(np.int32)
  context, continuation = choice.encode_pair(encode, 'The sky is ', 'blue')
  assert bytes(context.astype(np.uint8)) == b'The sky is'
  assert bytes(continuation.astype(np.uint8)) == b' blue'  # The space moved to the choice.


@pytest.mark.parametrize('shape', [(4, 2), (8, 1)])
def test_each_choice_scores_its_log_likelihood_given_the_context(paths, shape, devices):
  """Against the model run on [EOS] + context + choice alone, unpadded: within 1e-5, on
  two meshes; acc and acc_norm follow from those numbers."""
  del devices
  t = trainer('char_lm', **_overrides(paths, **{'mesh.shape': shape}))
  t.run(5)
  task = choice.load(paths['task'], t.dataset.encode, SEQ, t.dataset.eos_id)
  with_task = dataclasses.replace(t.setup, choice_tasks=(task,))  # As setup.checked loads it.
  got = train.evaluate(t.eval_step, t.state, with_task, t.setup.jit_score_step())
  with t.scope():
    logliks = np.concatenate([np.asarray(t.setup.jit_score_step()(
        t.state.params, feed.to_global(batch, t.setup.batch_sharding, 16))['loglik'])
        for batch in choice.batches(task, 16, slice(None))])
  # The model on each text alone, from position 0; what follows it (zeros) a causal model
  # does not see.
  log_probs = jax.jit(lambda p, x: jax.nn.log_softmax(t.model.apply({'params': p}, x)))
  want, row = [], 0
  for item in ITEMS:
    scores = []
    for c in item['choices']:
      context, continuation = choice.encode_pair(t.dataset.encode, item['context'], c)
      full = np.concatenate([[t.dataset.eos_id], context, continuation])[-(SEQ + 1):]
      inputs = np.zeros((1, SEQ), np.int32)
      inputs[0, :len(full) - 1] = full[:-1]
      logp = np.asarray(log_probs(t.state.params, inputs))[0]
      n = len(continuation)
      scores.append(logp[np.arange(len(full) - 1)[-n:], full[1:][-n:]].sum())
      assert logliks[row] == pytest.approx(scores[-1], abs=1e-5, rel=1e-5)
      row += 1
    want.append(scores)
  acc = np.mean([np.argmax(s) == i['answer'] for s, i in zip(want, ITEMS)])
  norm = np.mean([np.argmax(np.array(s) / [len(c.encode()) for c in i['choices']]) == i['answer']
                  for s, i in zip(want, ITEMS)])
  assert got['eval/toy/acc'] == pytest.approx(acc) and got['eval/toy/acc_norm'] == pytest.approx(norm)


def test_the_loop_writes_acc_and_acc_norm_at_every_eval(paths, tmp_path, devices):
  del devices
  config = load_config('char_lm', **_overrides(paths, **{
      'mesh.shape': (4, 2), 'train.steps': 20, 'eval.every_steps': 10,
      'checkpoint.every_steps': 20}))
  train.train_and_evaluate(config, str(tmp_path / 'run'))
  rows = [r for r in read_metrics(tmp_path / 'run') if 'eval/loss' in r]
  assert [r['step'] for r in rows] == [10, 20]
  for r in rows:
    assert 0 <= r['eval/toy/acc'] <= 1 and 0 <= r['eval/toy/acc_norm'] <= 1
    assert r['eval/toy/acc'] in (0, 0.25, 0.5, 0.75, 1)  # Of 4 items.


def test_items_that_do_not_fit_are_left_out_and_none_left_is_an_error(paths, tmp_path, caplog):
  encode = lambda text: np.frombuffer(text.encode(), np.uint8).astype(np.int32)
  task = choice.load(paths['task'], encode, 12, 256)  # Choices of 17 and 25 bytes do not fit.
  np.testing.assert_array_equal(task.answers, [0, 1])  # Items 2 and 3.
  assert '2 of 4 items' in caplog.text
  with pytest.raises(ZooError, match=r'config\.eval\.choice_tasks: no item of .* fits '
                                     r'data\.seq_len=2'):
    choice.load(paths['task'], encode, 2, 256)


@pytest.mark.parametrize('lines,message', [
    (['{"context": "a", "choices": ["b", "c"], "answer": 0}', '{oops'], r'line 2 is not JSON'),
    (['{"context": "a", "choices": ["b"], "answer": 0}'], r'line 1: expected \{"context": str'),
    (['{"context": "a", "choices": ["b", "c"], "answer": 2}'], r'line 1: expected'),
    (['{"context": 1, "choices": ["b", "c"], "answer": 0}'], r'line 1: expected'),
    ([], r'has no items'),
    (None, r'is not a file; give a JSON Lines task file or one of numpy_line_order'),
])
def test_bad_task_files_are_one_line_naming_file_and_line(paths, tmp_path, lines, message):
  task = tmp_path / 'bad.jsonl'
  if lines is not None:
    task.write_text('\n'.join(lines) + '\n')
  config = load_config('char_lm', **_overrides(paths, **{'eval.choice_tasks': (str(task),),
                                                         'mesh.shape': (4, 2)}))
  with pytest.raises(ZooError, match=r'config\.eval\.choice_tasks: .*' + message):
    train.train_and_evaluate(config, str(tmp_path / 'run'))
  assert not (tmp_path / 'run').exists()


def test_choice_tasks_need_a_tokenizer(tmp_path):
  config = load_config('mlp_digits', **{'eval.choice_tasks': ('numpy_line_order',)})
  with pytest.raises(ZooError, match=r'config\.eval\.choice_tasks: multiple-choice tasks score '
                                     r"text, but 'digits' data has no tokenizer"):
    setup_lib.checked(config)


def test_the_shipped_task_is_well_formed():
  items = choice.read_items(choice.BUILTIN['numpy_line_order'])
  assert len(items) == 200 and all(len(i['choices']) == 4 for i in items)
  for i in items:  # Four distinct orders of the same words, with the same indentation.
    choices = i['choices']
    assert len(set(choices)) == 4 and len({tuple(sorted(c.split())) for c in choices}) == 1
    assert len({c[:len(c) - len(c.lstrip())] for c in choices}) == 1
  answers = np.bincount([i['answer'] for i in items], minlength=4)
  assert answers.min() > 30  # The answer's place is drawn uniformly.
  assert len({i['context'] for i in items}) == 200
