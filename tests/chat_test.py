"""Chat data (zoo.data.chat, `zoo.prepare chat`): conversations rendered with a model's
chat template exactly as transformers' apply_chat_template renders and tokenizes them
(ChatML with a default system turn, Llama 3's headers with a BOS, Gemma's turns with an
error for a system role), a loss mask on the assistant's turns only (equal to transformers'
assistant mask where the template marks generation blocks), packed as documents; and
experiments/finetune_chat.py trains on it from an imported model, the loss over the
assistant's tokens only, with a reply sampled at each eval."""
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, experiment, read_metrics
from zoo.data import chat
from zoo.errors import ConfigError

transformers = pytest.importorskip('transformers')

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}"
    "<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
# Written over several indented lines, as many are: trim_blocks and lstrip_blocks matter.
GEMMA = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] == 'system' %}
        {{ raise_exception('System role not supported') }}
    {% endif %}
    {% if message['role'] == 'assistant' %}
        {% set role = 'model' %}
    {% else %}
        {% set role = message['role'] %}
    {% endif %}
<start_of_turn>{{ role }}
{{ message['content'] | trim }}<end_of_turn>
{% endfor %}
{% if add_generation_prompt %}
<start_of_turn>model
{% endif %}"""
# ChatML marking the assistant's reply and its end with generation blocks (TRL's style).
MARKED = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\\n' }}{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}")
# Qwen3-style: earlier turns' reasoning is dropped once a later user turn follows.
DROPS_REASONING = (
    "{% for message in messages %}{% if message['role'] == 'assistant' and not loop.last %}"
    "{{ '<|im_start|>assistant\\n' + message['content'].split('</think>')[-1] + '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIAL = ['<|endoftext|>', '<|im_start|>', '<|im_end|>', '<|begin_of_text|>',
           '<|start_header_id|>', '<|end_header_id|>', '<|eot_id|>', '<bos>', '<start_of_turn>',
           '<end_of_turn>']
TEMPLATES = {'chatml': (CHATML, {'eos_token': '<|im_end|>', 'pad_token': '<|endoftext|>'}),
             'llama3': (LLAMA3, {'bos_token': '<|begin_of_text|>', 'eos_token': '<|eot_id|>'}),
             'gemma': (GEMMA, {'bos_token': '<bos>', 'eos_token': '<end_of_turn>'}),
             'marked': (MARKED, {'eos_token': '<|im_end|>'})}
CONVERSATIONS = [
    [{'role': 'user', 'content': 'Hi there'},
     {'role': 'assistant', 'content': 'Hello! How can I help?'}],
    [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'What is 2+2?'},
     {'role': 'assistant', 'content': 'Four.'},
     {'role': 'user', 'content': 'And 3+3? Ünïcode ☃'},
     {'role': 'assistant', 'content': ' Six, naturally.  '}],
]


@pytest.fixture(scope='module')
def tokenizer_dirs(tmp_path_factory):
  """name -> a tokenizer directory as transformers saves it (tokenizer.json, its config and
  chat_template.jinja): a byte-level BPE with merges and the templates' special tokens."""
  from zoo.data import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
  root = tmp_path_factory.mktemp('tokenizers')
  text = [' '.join(m['content'] for c in CONVERSATIONS for m in c) * 3,
          'What is the answer? Hello there, how can I help you today?'] * 20
  base = tokenizer_lib.train_bpe(iter(text), 400)
  base.add_special_tokens(SPECIAL)
  out = {}
  for name, (template, special) in TEMPLATES.items():
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=base, chat_template=template,
                                                **special)
    fast.save_pretrained(root / name)
    out[name] = str(root / name)
  return out


def _zoo(directory, messages, add_generation_prompt=False):
  from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel
  renderer = chat.Renderer(chat.load_template(directory))
  text, _ = renderer.render(messages, add_generation_prompt)
  tokenizer = Tokenizer.from_file(os.path.join(directory, 'tokenizer.json'))
  return text, tokenizer.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize('name', ['chatml', 'llama3', 'gemma', 'marked'])
@pytest.mark.parametrize('generation_prompt', [False, True])
def test_rendering_and_ids_equal_apply_chat_template(name, generation_prompt, tokenizer_dirs):
  hf = transformers.AutoTokenizer.from_pretrained(tokenizer_dirs[name])
  for messages in CONVERSATIONS:
    if name == 'gemma' and messages[0]['role'] == 'system':
      with pytest.raises(ConfigError, match=r'the chat template raised: System role not '):
        chat.Renderer(chat.load_template(tokenizer_dirs[name])).assistant_spans(messages, 'x')
      continue
    text, ids = _zoo(tokenizer_dirs[name], messages, generation_prompt)
    assert text == hf.apply_chat_template(messages, tokenize=False,
                                          add_generation_prompt=generation_prompt)
    assert ids == hf.apply_chat_template(messages, tokenize=True, return_dict=False,
                                         add_generation_prompt=generation_prompt)
    special = set(hf.convert_tokens_to_ids(SPECIAL))
    assert special & set(ids) and set(ids) - special - set(range(257))  # Specials and merges.


def _masked_text(directory, messages):
  from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel
  tokenizer = Tokenizer.from_file(os.path.join(directory, 'tokenizer.json'))
  text, spans = chat.Renderer(chat.load_template(directory)).assistant_spans(messages, 'x')
  ids, mask = chat.encode(tokenizer, text, spans)
  return ids, mask, tokenizer.decode([int(i) for i, m in zip(ids, mask) if m],
                                     skip_special_tokens=False)


def test_the_mask_equals_transformers_assistant_mask_where_the_template_marks_it(tokenizer_dirs):
  hf = transformers.AutoTokenizer.from_pretrained(tokenizer_dirs['marked'])
  for messages in CONVERSATIONS:
    ids, mask, _ = _masked_text(tokenizer_dirs['marked'], messages)
    want = hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
    assert list(ids) == want['input_ids'] and list(mask) == want['assistant_masks']


@pytest.mark.parametrize('name,closes', [('chatml', '<|im_end|>\n'), ('llama3', '<|eot_id|>'),
                                         ('gemma', '<end_of_turn>\n')])
def test_the_mask_covers_exactly_the_assistant_turns(name, closes, tokenizer_dirs):
  """Templates that mark nothing: the masked tokens are each assistant reply as the
  template writes it (Llama 3 and Gemma trim it) and what closes its turn, nothing else."""
  for messages in CONVERSATIONS[:1 if name == 'gemma' else 2]:
    _, mask, masked = _masked_text(tokenizer_dirs[name], messages)
    replies = [m['content'] if name == 'chatml' else m['content'].strip()
               for m in messages if m['role'] == 'assistant']
    assert masked == ''.join(r + closes for r in replies), masked
    assert 0 < mask.mean() < 0.6


def test_a_template_that_rewrites_earlier_turns_is_refused_unless_marked(tokenizer_dirs, tmp_path):
  (tmp_path / 'drops.jinja').write_text(DROPS_REASONING)
  messages = [{'role': 'user', 'content': 'Hi'},
              {'role': 'assistant', 'content': '<think>greet</think>Hello!'},
              {'role': 'user', 'content': 'Bye'}, {'role': 'assistant', 'content': 'Bye!'}]
  template = chat.load_template(tokenizer_dirs['chatml'], str(tmp_path / 'drops.jinja'))
  with pytest.raises(ConfigError, match=r'^conversation 7: the chat template \(.*drops\.jinja\) '
                                        r'renders the start of this conversation differently'):
    chat.Renderer(template).assistant_spans(messages, 'conversation 7')


@pytest.fixture(scope='module')
def chat_data(tokenizer_dirs, tmp_path_factory):
  """zoo.prepare chat over 60 conversations with the ChatML tokenizer directory."""
  root = tmp_path_factory.mktemp('chat')
  with open(root / 'chat.jsonl', 'w', encoding='utf-8') as f:
    for i in range(60):
      f.write(json.dumps({'messages': [
          {'role': 'user', 'content': f'What is {i} plus {i}?'},
          {'role': 'assistant', 'content': f'{i} plus {i} is {2 * i}.'}]}) + '\n')
  result = subprocess.run([sys.executable, '-m', 'zoo.prepare', 'chat',
                           f'--input={root}/chat.jsonl',
                           f'--output={root}/data', f'--tokenizer={tokenizer_dirs["chatml"]}',
                           '--val_fraction=0.1'], cwd=REPO, capture_output=True, text=True,
                          timeout=120, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'assistant tokens' in result.stderr
  return str(root / 'data')


def test_prepared_conversations_train_only_on_the_assistants_tokens(chat_data):
  """Batches of packed conversations: a target counts (mask 1) exactly where it is a
  token of an assistant reply or its <|im_end|>\\n; padding and every other token 0."""
  import ml_collections  # pylint: disable=import-outside-toplevel
  from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel
  from zoo import data  # pylint: disable=import-outside-toplevel
  dataset = data.load(ml_collections.ConfigDict(
      {'name': 'tokens', 'path': chat_data, 'seq_len': 128, 'windows': 'documents'}), 0)
  tokenizer = Tokenizer.from_file(os.path.join(chat_data, 'tokenizer.json'))
  batch = dataset.train_batch(0, 16, slice(None))
  checked = 0
  for targets, mask, segments in zip(batch['targets'], batch['mask'], batch['segments']):
    counted = tokenizer.decode([int(t) for t, m in zip(targets, mask) if m],
                               skip_special_tokens=False)
    for segment in set(segments[segments > 0].tolist()):
      text = tokenizer.decode([int(t) for t in targets[segments == segment]],
                              skip_special_tokens=False)
      after = text.split('<|im_start|>assistant\n')[1:]
      if after and '<|im_end|>\n' in after[0]:  # A whole reply in this window.
        reply = after[0].split('<|im_end|>')[0]
        assert reply + '<|im_end|>\n' in counted, (reply, counted)
        checked += 1
    assert '<|im_start|>' not in counted and 'What is' not in counted
    assert not mask[segments == 0].any()
  assert checked >= 8
  assert dataset.sample_prompt and tokenizer.decode(dataset.sample_prompt, skip_special_tokens=False
                                                    ).endswith('<|im_start|>assistant\n')
  eos = tokenizer.token_to_id('<|im_end|>')
  assert eos in dataset.stop_ids


@pytest.mark.parametrize('line,message', [
    ('{"text": "hi"}', r'line 2: expected \{"messages": \[\{"role": \.\.\., "content": \.\.\.\}'),
    ('{"messages": [{"role": "user", "content": "hi"}]}', r'line 2: the conversation has no '
                                                          r'assistant message'),
    ('{"messages": [{"role": "user"}]}', r'line 2: each message needs a "role" and a "content"'),
    ('not json', r'line 2 is not JSON'),
])
def test_bad_conversations_are_named_by_line(line, message, tokenizer_dirs, tmp_path):
  good = json.dumps({'messages': CONVERSATIONS[0]})
  (tmp_path / 'bad.jsonl').write_text(good + '\n' + line + '\n')
  result = subprocess.run([sys.executable, '-m', 'zoo.prepare', 'chat',
                           f'--input={tmp_path}/bad.jsonl', f'--output={tmp_path}/out',
                           f'--tokenizer={tokenizer_dirs["chatml"]}'], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False)
  assert result.returncode == 1 and 'Traceback' not in result.stderr
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith(f'zoo: error: --input: {tmp_path}/bad.jsonl line 2') and (
      __import__('re').search(message, last)), last
  assert not (tmp_path / 'out').exists()


def test_sft_from_an_import_learns_the_replies_and_samples_one(chat_data, tokenizer_dirs,
                                                              tmp_path, caplog, devices):
  """experiments/finetune_chat.py:smoke on a tiny random Qwen2 imported with the ChatML
  tokenizer: the loss (over assistant tokens) falls, eval reports the held-out replies'
  loss, and each eval logs a reply to the held-out conversation's opening."""
  import torch  # pylint: disable=import-outside-toplevel
  from zoo.hf import transfer  # pylint: disable=import-outside-toplevel
  from zoo.run import config as cfg, train  # pylint: disable=import-outside-toplevel
  del devices
  hf_dir = tmp_path / 'qwen'
  torch.manual_seed(0)
  transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
      vocab_size=416, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
      tie_word_embeddings=True)).save_pretrained(hf_dir)
  for name in os.listdir(tokenizer_dirs['chatml']):
    with open(os.path.join(tokenizer_dirs['chatml'], name), 'rb') as src, \
        open(hf_dir / name, 'wb') as dst:
      dst.write(src.read())
  transfer.import_model(str(hf_dir), str(tmp_path / 'imported'))
  assert (tmp_path / 'imported' / 'chat_template.jinja').exists()  # Kept for chat data.
  config = cfg.load_experiment(experiment('finetune_chat'), f'{tmp_path / "imported"},smoke')
  config.data.path, config.mesh.shape = chat_data, (4, 2)
  config.train.log_every_steps, config.checkpoint.async_save = 1, False
  caplog.set_level('INFO')
  train.train_and_evaluate(config, str(tmp_path / 'sft'))
  rows = read_metrics(str(tmp_path / 'sft'))
  losses = [r['train/loss'] for r in rows if 'train/loss' in r]
  assert losses[-1] < 0.8 * losses[0], losses  # 6.08 -> 4.23 measured.
  assert [r['step'] for r in rows if 'eval/loss' in r] == [6, 12]
  replies = [r.getMessage() for r in caplog.records if r.getMessage().startswith('sample at')]
  assert len(replies) == 2 and all("<|im_start|>assistant\\n' -> '" in r for r in replies), replies
