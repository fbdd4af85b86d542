"""lm-evaluation-harness on zoo runs (zoo.run.harness, python -m zoo.evaluate), offline: a
task defined in a local YAML file over a local JSON Lines file gives the same
log-likelihoods through an imported tiny GPT-2 as through the harness's own `hf` model
(within 1e-4), rolling log-likelihoods and greedy generations agree too, and the command
prints the table and writes its results."""
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, tiny_gpt2

lm_eval = pytest.importorskip('lm_eval')

CHOICE_TASK = """task: zoo_toy_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""
ROLLING_TASK = """task: zoo_toy_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{context}}}}"
metric_list:
  - metric: word_perplexity
"""
GENERATE_TASK = """task: zoo_toy_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{choices[0]}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""
ITEMS = [{'context': 'The sky is', 'choices': [' blue', ' green', ' made of cheese'], 'answer': 0},
         {'context': 'def f(x):\n   ', 'choices': [' return x', ' pass', ' 1 +'], 'answer': 1},
         {'context': 'a b c d e f g h i j k l m n o p q r s t u v w x y z ' * 2,
          'choices': ['again', 'zzz'], 'answer': 0}]
TASKS = ['zoo_toy_choice', 'zoo_toy_rolling', 'zoo_toy_generate']


@pytest.fixture(scope='module')
def setting(tmp_path_factory):
  root = tmp_path_factory.mktemp('harness')
  data = root / 'items.jsonl'
  data.write_text(''.join(json.dumps(i) + '\n' for i in ITEMS))
  tasks = root / 'tasks'
  tasks.mkdir()
  for name, text in zip(TASKS, (CHOICE_TASK, ROLLING_TASK, GENERATE_TASK)):
    (tasks / f'{name}.yaml').write_text(text.format(data=data))
  hf = tiny_gpt2(root / 'hf')
  from zoo.hf import transfer  # pylint: disable=import-outside-toplevel
  transfer.import_model(hf, str(root / 'zoo'))
  os.environ.update(HF_HUB_OFFLINE='1', HF_DATASETS_OFFLINE='1')
  return {'hf': hf, 'zoo': str(root / 'zoo'), 'tasks': str(tasks)}


def _samples(results, task):
  return [s['resps'] for s in sorted(results['samples'][task], key=lambda s: s['doc_id'])]


def test_the_same_task_scores_alike_through_zoo_and_through_the_harness_hf_model(setting,
                                                                                 devices):
  """Every loglikelihood request's log-probability within 1e-4 and its greedy flag equal;
  each rolling log-likelihood within 1e-4; the greedy generations equal; so the metrics."""
  del devices
  from lm_eval.tasks import TaskManager  # pylint: disable=import-outside-toplevel
  from zoo.run import harness  # pylint: disable=import-outside-toplevel
  hf = lm_eval.simple_evaluate(
      model='hf', model_args=f'pretrained={setting["hf"]},device=cpu,dtype=float32',
      tasks=TASKS, task_manager=TaskManager(include_path=setting['tasks'], include_defaults=False),
      log_samples=True, batch_size=4)
  zoo = harness.evaluate(setting['zoo'], TASKS, setting['tasks'], batch_size=4,
                         mesh_shape='4,2', log_samples=True)
  compared = 0
  for got, want in zip(_samples(zoo, 'zoo_toy_choice'), _samples(hf, 'zoo_toy_choice'),
                       strict=True):
    for (g_ll, g_greedy), (w_ll, w_greedy) in zip((r[0] for r in got), (r[0] for r in want),
                                                  strict=True):
      assert abs(float(g_ll) - float(w_ll)) < 1e-4 and g_greedy == w_greedy
      compared += 1
  assert compared == sum(len(i['choices']) for i in ITEMS)
  rolled = 0
  for got, want in zip(_samples(zoo, 'zoo_toy_rolling'), _samples(hf, 'zoo_toy_rolling'),
                       strict=True):
    assert abs(float(got[0][0]) - float(want[0][0])) < 1e-4
    rolled += 1
  assert rolled > 0
  assert _samples(zoo, 'zoo_toy_generate') == _samples(hf, 'zoo_toy_generate')
  assert any(s[0][0] for s in _samples(zoo, 'zoo_toy_generate'))  # It generated text.
  for task in TASKS:
    for metric, value in zoo['results'][task].items():
      if isinstance(value, float) and 'stderr' not in metric:
        assert value == pytest.approx(hf['results'][task][metric], rel=1e-4, abs=1e-6), metric


def test_a_rolling_window_longer_than_max_len_scores_as_the_hf_model_does(setting, devices):
  """A text of 3 x max_len tokens and more: the harness cuts it into windows (each token
  scored once); zoo's total equals the harness's hf model's within 1e-4."""
  del devices
  from lm_eval.models.huggingface import HFLM  # pylint: disable=import-outside-toplevel
  from zoo.run import harness  # pylint: disable=import-outside-toplevel
  model = harness.ZooLM(setting['zoo'], batch_size=4)
  text = ''.join(chr(97 + i % 26) for i in range(3 * model.max_length + 5))
  request = type('Request', (), {'args': (text,)})()
  got = model.loglikelihood_rolling([request])[0]
  want = HFLM(pretrained=setting['hf'], device='cpu', dtype='float32',
              batch_size=4).loglikelihood_rolling([request])[0]
  assert model.max_length == 32 and got == pytest.approx(want, abs=1e-4) and got < -100


def test_a_batch_size_that_does_not_divide_the_batch_shards_scores_alike(setting, devices):
  """--batch_size 3 on a mesh of 2 batch shards: the rows are not split over the mesh
  (setup.placed), and the scores equal those of 2 rows split over it."""
  del devices
  from zoo.parallel import sharding  # pylint: disable=import-outside-toplevel
  from zoo.run import harness  # pylint: disable=import-outside-toplevel
  requests = [type('Request', (), {'args': (text,)})() for text in
              ('The sky is blue.', 'def f(x):\n    return x', 'abc' * 5)]
  scores = {}
  for rows in (3, 2):
    model = harness.ZooLM(setting['zoo'], batch_size=rows, mesh_shape='2,4')
    assert sharding.batch_shards(model.setup.mesh, model.setup.rules) == (1 if rows == 3 else 2)
    scores[rows] = model.loglikelihood_rolling(requests)
  assert scores[3] == pytest.approx(scores[2], abs=1e-5)


def test_local_tasks_are_found_without_indexing_the_harness_own(setting, monkeypatch):
  """Tasks that --include_path defines are looked up there alone (the harness's own 15k task
  files take seconds to index); a name it lacks gets the full index."""
  import lm_eval.tasks  # pylint: disable=import-outside-toplevel
  from zoo.run import harness  # pylint: disable=import-outside-toplevel
  built, real = [], lm_eval.tasks.TaskManager
  def manager(include_path=None, include_defaults=True):
    built.append(include_defaults)
    return 'full' if include_defaults else real(include_path=include_path, include_defaults=False)
  monkeypatch.setattr(lm_eval.tasks, 'TaskManager', manager)
  find = harness._task_manager  # pylint: disable=protected-access
  harness._index.cache_clear()  # pylint: disable=protected-access
  try:
    assert set(TASKS) <= set(find(setting['tasks'], tuple(TASKS)).all_tasks)
    assert built == [False]
    assert find(setting['tasks'], ('zoo_toy_choice', 'hellaswag')) == 'full'
    assert find(setting['tasks'], ('arc_easy',)) == 'full'
    assert built == [False, True]  # Each index built once.
  finally:
    harness._index.cache_clear()  # pylint: disable=protected-access


def test_the_command_prints_the_table_and_writes_results(setting, tmp_path):
  out = tmp_path / 'results.json'
  env = {**os.environ, 'HF_HUB_OFFLINE': '1', 'HF_DATASETS_OFFLINE': '1'}
  run = subprocess.run(
      [sys.executable, '-m', 'zoo.evaluate', f'--workdir={setting["zoo"]}',
       '--tasks=zoo_toy_choice', f'--include_path={setting["tasks"]}', f'--output={out}',
       '--cpu_devices=2', '--mesh_shape=2,1'], cwd=REPO, env=env, capture_output=True,
      text=True, timeout=300, check=False)
  assert run.returncode == 0, run.stderr[-3000:]
  assert 'zoo_toy_choice' in run.stdout and 'acc_norm' in run.stdout
  results = json.loads(out.read_text())
  assert 0 <= results['results']['zoo_toy_choice']['acc,none'] <= 1


def test_a_run_that_is_no_language_model_is_refused(tmp_path, devices):
  del devices
  from conftest import load_config  # pylint: disable=import-outside-toplevel
  from zoo.errors import ZooError  # pylint: disable=import-outside-toplevel
  from zoo.run import harness, train  # pylint: disable=import-outside-toplevel
  train.train_and_evaluate(load_config('mlp_digits', **{'train.steps': 1}), str(tmp_path / 'mlp'))
  with pytest.raises(ZooError, match=r"--workdir: .* trained model 'mlp', not a language model; give a "
                                     r'transformer_lm run'):
    harness.ZooLM(str(tmp_path / 'mlp'))
