"""The loss's chunks chosen for the machine (model.loss_chunks=0): the fewest whose train step
fits the device's memory, whole logits where they fit, found by compiling; a run and its
--dry_run plan say what was chosen and why."""
import logging

import jax
import pytest

from conftest import load_config
from zoo.run import chunks, memory, plan, train
from zoo.run import config as cfg
from zoo.run import setup as setup_lib

# A 32,768 vocabulary over 512 tokens: the memory-lean rule takes 4 chunks of 128
# (layers.LOSS_CHUNK_ELEMENTS), so auto chooses among 1, 2 and 4.
BIG_VOCAB = {'model.vocab_size': 32768, 'data.seq_len': 512, 'model.max_len': 512,
             'model.num_layers': 1, 'mesh.shape': (8, 1), 'eval.batch_size': 8}
# Over 256 tokens, 2 rows, the vocabulary split 8 ways: among 1 and 2, quick to compile and run.
COMPILED = {**BIG_VOCAB, 'data.seq_len': 256, 'model.max_len': 256, 'mesh.shape': (1, 8),
            'train.batch_size': 2, 'eval.batch_size': 2}


def _setup(**overrides):
  config = load_config('char_lm', **{**BIG_VOCAB, **overrides})
  cfg.validate(config, jax.device_count())
  return setup_lib.checked(config, plan=True)


def _fake_compiles(monkeypatch, peak, eval_peak=lambda n: 1):
  """chunks' compiles replaced: the train step's peak `peak(chunks)` bytes per device (or a
  Compiled it returns), the eval step's `eval_peak(chunks)`; returns the train steps'
  chunks compiled, in order, and the eval steps'."""
  compiled = {'train': [], 'eval': []}

  def fake(setup, step):
    n = setup.model.loss_chunks
    compiled[step].append(n)
    got = (peak if step == 'train' else eval_peak)(n)
    return got if isinstance(got, memory.Compiled) else memory.Compiled(memory={'peak': got})
  monkeypatch.setattr(chunks, '_compile', fake)
  return compiled


def test_the_search_takes_the_fewest_chunks_that_fit(devices, monkeypatch):
  del devices
  s = _setup()
  logits = lambda n: chunks.logit_bytes(s, n)
  per_logit = chunks.BYTES_PER_LOGIT['cpu'] / 4  # The estimate, here exact.
  other = 100 * 2**20
  step = lambda n: other + per_logit * logits(n)
  room = lambda n: int(step(n) / chunks.FILL) + 1  # The limit that fits n chunks' step.
  # Whole logits fit: one compile of each step, at 1.
  compiled = _fake_compiles(monkeypatch, step)
  fitted, choice = chunks.fitted(s, room(1), 'test')
  assert (choice.chunks, compiled, fitted.model.loss_chunks) == (1, {'train': [1],
                                                                      'eval': [1]}, 1)
  assert choice.reason.startswith("whole logits: the train step's peak")
  assert fitted.config.model.loss_chunks == 1 and s.config.model.loss_chunks == 0
  # Whole logits do not, 2 chunks do: measured at 1, the step's other memory says 2.
  compiled = _fake_compiles(monkeypatch, step)
  _, choice = chunks.fitted(s, room(2), 'test')
  assert (choice.chunks, compiled['train']) == (2, [1, 2])
  assert choice.peaks[1] == step(1) and '1 chunk(s)' in choice.reason, choice.reason
  # A prediction that fails (the step at 2 chunks holds more than measured at 1 said): the
  # search goes on to a step that fits.
  compiled = _fake_compiles(monkeypatch, lambda n: step(n) + (logits(1) if n == 2 else 0))
  _, choice = chunks.fitted(s, room(2), 'test')
  assert (choice.chunks, compiled['train']) == (4, [1, 2, 4])
  # Hopeless without compiling: the state and one chunk's logits pass the limit at 1 and 2.
  held = chunks.logit_bytes(s, 4) * 3
  compiled = _fake_compiles(monkeypatch, lambda n: held)
  _, choice = chunks.fitted(s, int(held / chunks.FILL) + 1, 'test')
  assert (choice.chunks, compiled['train']) == (4, [4])
  # The eval step, compiled where the train step fits, must fit too.
  compiled = _fake_compiles(monkeypatch, step, lambda n: 2 * step(1) if n == 1 else 1)
  _, choice = chunks.fitted(s, room(1), 'test')
  assert (choice.chunks, compiled) == (2, {'train': [1, 2], 'eval': [1, 2]})
  # Nothing fits: the most auto takes, said so.
  compiled = _fake_compiles(monkeypatch, lambda n: 2**40)
  _, choice = chunks.fitted(s, 2**30, 'test')
  assert choice.chunks == 4 and choice.reason.startswith('the most auto takes'), choice.reason
  # A refusal that is not for memory (a kernel's scoped VMEM) is stepped over.
  vmem = memory.Compiled(refusal='RESOURCE_EXHAUSTED: Ran out of memory in memory space vmem')
  compiled = _fake_compiles(monkeypatch, lambda n: vmem if n == 1 else step(n))
  _, choice = chunks.fitted(s, room(1), 'test')
  assert (choice.chunks, compiled['train']) == (2, [1, 2])
  # Set by hand, or small logits: nothing compiled.
  compiled = _fake_compiles(monkeypatch, step)
  assert chunks.fitted(_setup(**{'model.loss_chunks': 8}), 1, 'test')[1].chunks == 8
  small = _setup(**{'model.vocab_size': None})  # The data's 128 characters.
  fitted, choice = chunks.fitted(small, 1, 'test')
  assert (choice.chunks, fitted.model.loss_chunks, compiled) == (1, 0, {'train': [],
                                                                        'eval': []})


@pytest.mark.parametrize('message,needed', [
    ('RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space '
     'hbm. Used 18.54G of 15.75G hbm. Exceeded hbm capacity by 2.79G.', int(18.54 * 2**30)),
    ('RESOURCE_EXHAUSTED: Ran out of memory on HBM: ... (20.50G) exceeds available HBM '
     '(15.75G)', int(20.5 * 2**30)),
    ('RESOURCE_EXHAUSTED: Ran out of memory in memory space vmem while allocating', None)])
def test_a_compilers_refusal_says_what_it_needs_in_either_form(message, needed):
  """Both forms of the TPU compiler's HBM refusal give what the step needs (a memory
  refusal, which the chunks' search and --max_batch step past by size); a kernel's scoped
  VMEM gives nothing (another reason)."""
  class Lowered:
    def compile(self):
      raise jax.errors.JaxRuntimeError(message)
  jitted = type('Jitted', (), {'lower': lambda self, *args: Lowered()})()
  refused = memory.compile_step('tpu', jitted)
  assert refused.refusal == message and refused.needed == needed


def test_a_plan_takes_whole_logits_where_they_fit_else_the_fewest_chunks(devices):
  """Compiled by XLA:CPU: with memory to spare the plan takes whole logits; with a budget
  just under that step's peak, 2 chunks, whose step fits it."""
  del devices
  config = load_config('char_lm', **COMPILED)
  roomy = plan.make_plan(config, device_memory_gib=64)
  assert roomy['loss']['chunks'] == 1 and roomy['fits'], roomy['loss']
  whole = roomy['loss']['peaks'][1]
  assert whole == roomy['compiled_memory']['peak']
  budget = (whole - 2**20) / chunks.FILL / 2**30
  tight = plan.make_plan(config, device_memory_gib=budget)
  assert tight['loss']['chunks'] == 2 and tight['fits'], tight['loss']
  assert tight['loss']['peaks'][1] == whole
  assert tight['compiled_memory']['peak'] == tight['loss']['peaks'][2] < whole - 2**20
  assert ("loss: logits of 2 chunk(s) of 128 tokens in turn, one live at a time: 4.00 MiB per "
          "device (float32); the fewest that fit: the train step's peak") in plan.format_plan(tight)


def test_a_run_says_what_it_chose_and_keeps_auto_in_its_config(tmp_path, devices, monkeypatch,
                                                               caplog):
  """A run out of room for whole logits trains in chunks and logs why; its config.json
  keeps 0 (auto), so a resume on another machine chooses for that one."""
  del devices
  config = load_config('char_lm', **{**COMPILED, 'train.steps': 2, 'eval.every_steps': 2,
                                     'checkpoint.every_steps': 2, 'eval.sample': False,
                                     'eval.max_batches': 1})
  cfg.validate(config, jax.device_count())
  whole = chunks.fitted(setup_lib.checked(config), 2**40)[1].peaks[1]
  monkeypatch.setattr(memory, 'limit_per_device', lambda: (int((whole - 2**20) / chunks.FILL),
                                                           'a test device has'))
  compiled, compile_steps = [], train.compile_steps

  def recording(setup, state):  # The chunks of the program the loop runs.
    compiled.append(setup.model.loss_chunks)
    return compile_steps(setup, state)
  monkeypatch.setattr(train, 'compile_steps', recording)
  with caplog.at_level(logging.INFO, logger='absl'):
    train.train_and_evaluate(config, str(tmp_path))
  assert compiled == [2]
  assert 'loss: logits of 2 chunk(s) of 128 tokens' in caplog.text, caplog.text[-2000:]
  assert '"loss_chunks": 0' in (tmp_path / 'config.json').read_text()
