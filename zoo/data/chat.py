"""Chat conversations as training documents: a model's own chat template, rendered as
transformers renders it, and a loss mask that is 1 on the assistant's tokens only.

Input: JSON Lines, one conversation per line, `{"messages": [{"role": ..., "content": ...},
...]}` (the format of Hugging Face's chat datasets). The template is the Jinja template of
the model's tokenizer directory (`chat_template.jinja`, else `tokenizer_config.json`'s
"chat_template"; a file given with --chat_template wins), rendered with jinja2 in the
environment transformers' `apply_chat_template` uses (a sandbox, trim_blocks and
lstrip_blocks, loop controls, `raise_exception`, `tojson`, `strftime_now`, the
`{% generation %}` tag) and its variables (messages, add_generation_prompt, the special
tokens of tokenizer_config.json). The text is tokenized whole without added special
tokens, as `apply_chat_template(tokenize=True)` does.

Which characters are the assistant's: the spans of the template's `{% generation %}` blocks
where it marks them (what transformers' `return_assistant_tokens_mask` reads), else, for
each assistant message, from the end of the conversation before it rendered with the
generation prompt to the end of the conversation up to it (the reply and whatever the
template closes the turn with, e.g. `<|im_end|>`, so that the model learns to stop). A
template that renders a conversation's beginning differently once more follows (Qwen3's
drops earlier turns' reasoning) cannot be read that way: it is refused, naming the line,
unless it marks generation blocks. A token is masked in if its characters touch a span.
"""
import dataclasses
import datetime
import json
import os
from typing import Any, Optional

import numpy as np

from zoo.data import documents
from zoo.errors import ConfigError

GENERATION_TAG = '{% generation %}'


@dataclasses.dataclass(frozen=True)
class Template:
  """A chat template and the special tokens it may name."""
  source: str
  special: dict        # bos_token, eos_token, ... -> their strings.
  where: str           # The file it came from, for errors.

  @property
  def marks_generation(self) -> bool:
    return 'generation' in self.source and 'endgeneration' in self.source


def _token_string(value: Any) -> Optional[str]:
  """A special token in tokenizer_config.json: a string or an AddedToken dict."""
  if isinstance(value, str):
    return value
  if isinstance(value, dict) and isinstance(value.get('content'), str):
    return value['content']
  return None


def load_template(directory: str, template_file: str = '', flag: str = '--tokenizer') -> Template:
  """The chat template of a tokenizer directory (a Hugging Face model's, or a zoo workdir
  that imported one), or `template_file`; its special tokens from tokenizer_config.json and
  special_tokens_map.json."""
  config_file = os.path.join(directory, 'tokenizer_config.json')
  config = {}
  if os.path.isfile(config_file):
    try:
      with open(config_file, encoding='utf-8') as f:
        config = json.load(f)
    except ValueError as e:
      raise ConfigError(f'{flag}: {config_file} is not valid JSON ({e})') from None
  special = {}
  map_file = os.path.join(directory, 'special_tokens_map.json')
  if os.path.isfile(map_file):
    with open(map_file, encoding='utf-8') as f:
      special.update({k: v for k, value in json.load(f).items()
                      if (v := _token_string(value)) is not None})
  special.update({k: v for k, value in config.items()
                  if k.endswith('_token') and (v := _token_string(value)) is not None})
  if template_file:
    if not os.path.isfile(template_file):
      raise ConfigError(f'--chat_template: {template_file} is not a file; give a Jinja chat '
                        'template')
    with open(template_file, encoding='utf-8') as f:
      return Template(f.read(), special, template_file)
  jinja_file = os.path.join(directory, 'chat_template.jinja')
  if os.path.isfile(jinja_file):
    with open(jinja_file, encoding='utf-8') as f:
      return Template(f.read(), special, jinja_file)
  source = config.get('chat_template')
  if isinstance(source, list):  # Named templates: transformers uses 'default'.
    source = {t.get('name'): t.get('template') for t in source if isinstance(t, dict)}.get(
        'default')
  if not isinstance(source, str) or not source:
    raise ConfigError(f'{flag}: {directory} has no chat template (no chat_template.jinja, no '
                      '"chat_template" in tokenizer_config.json); give one with --chat_template')
  return Template(source, special, config_file)


def _environment():
  """transformers' chat-template environment, with the generation tag recording spans."""
  import jinja2  # pylint: disable=import-outside-toplevel
  import jinja2.ext  # pylint: disable=import-outside-toplevel
  from jinja2 import sandbox  # pylint: disable=import-outside-toplevel

  class Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body, recording where it went."""
    tags = {'generation'}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(['name:endgeneration'], drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method('_mark'), [], [], body).set_lineno(lineno)

    def _mark(self, caller):
      text = caller()
      blocks, spans = self.environment.zoo_track
      start = len(''.join(blocks))
      spans.append((start, start + len(text)))
      return text

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                              extensions=[Generation, jinja2.ext.loopcontrols])
  env.filters['tojson'] = lambda x, ensure_ascii=False, indent=None, separators=None, \
      sort_keys=False: json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                                  separators=separators, sort_keys=sort_keys)
  env.globals['raise_exception'] = raise_exception
  env.globals['strftime_now'] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env


class Renderer:
  """Renders conversations with one template (compiled once)."""

  def __init__(self, template: Template):
    import jinja2  # pylint: disable=import-outside-toplevel
    self.template, self.env = template, _environment()
    try:
      self.compiled = self.env.from_string(template.source)
    except jinja2.exceptions.TemplateError as e:
      raise ConfigError(f'--chat_template: {template.where}: the template does not parse '
                        f'({type(e).__name__}: {e})') from None

  def render(self, messages: list, add_generation_prompt: bool = False
             ) -> tuple[str, list[tuple[int, int]]]:
    """(text, the spans of its generation blocks)."""
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    blocks, spans = [], []
    self.env.zoo_track = (blocks, spans)
    for block in self.compiled.generate(messages=messages, tools=None, documents=None,
                                        add_generation_prompt=add_generation_prompt,
                                        **self.template.special):
      blocks.append(block)
    return ''.join(blocks), spans

  def assistant_spans(self, messages: list, where: str) -> tuple[str, list[tuple[int, int]]]:
    """(the conversation's text, the character spans of the assistant's turns)."""
    import jinja2  # pylint: disable=import-outside-toplevel
    try:
      text, marked = self.render(messages)
      if self.template.marks_generation:
        return text, marked
      spans = []
      for i, message in enumerate(messages):
        if message.get('role') != 'assistant':
          continue
        before, _ = self.render(messages[:i], add_generation_prompt=True)
        through, _ = self.render(messages[:i + 1])
        if not (text.startswith(before) and text.startswith(through) and len(before) <= len(
            through)):
          raise ConfigError(
              f'{where}: the chat template ({self.template.where}) renders the start of this '
              'conversation differently once more of it follows, so the assistant\'s turns '
              'cannot be told apart; mark them with {% generation %} ... {% endgeneration %} '
              'in the template (--chat_template)')
        spans.append((len(before), len(through)))
      return text, spans
    except jinja2.exceptions.TemplateError as e:
      raise ConfigError(f'{where}: the chat template raised: {e}') from None


def check_conversation(record: Any, where: str, field: str = 'messages') -> list:
  """The messages of one JSON Lines record, or ConfigError naming the line."""
  messages = record.get(field) if isinstance(record, dict) else None
  if not isinstance(messages, list) or not messages:
    raise ConfigError(f'{where}: expected {{"{field}": [{{"role": ..., "content": ...}}, ...]}}')
  for m in messages:
    if not isinstance(m, dict) or not isinstance(m.get('role'), str) or not isinstance(
        m.get('content'), str):
      raise ConfigError(f'{where}: each message needs a "role" and a "content" string, got '
                        f'{json.dumps(m)[:80]}')
  if not any(m['role'] == 'assistant' for m in messages):
    raise ConfigError(f'{where}: the conversation has no assistant message: nothing to learn')
  return messages


def encode(tokenizer: Any, text: str, spans: list[tuple[int, int]]
           ) -> tuple[np.ndarray, np.ndarray]:
  """(token ids, mask): the text tokenized whole without added special tokens, and 1 on
  each token whose characters touch an assistant span."""
  encoding = tokenizer.encode(text, add_special_tokens=False)
  ids = np.array(encoding.ids, np.int64)
  mask = np.zeros(len(ids), np.uint8)
  for i, (a, b) in enumerate(encoding.offsets):
    if any(a < e and s < max(b, a + 1) for s, e in spans):
      mask[i] = 1
  return ids, mask


def read_conversations(path: str, field: str = 'messages'):
  """(where, messages) for each line of a JSON Lines file."""
  for number, record in documents.json_records(path):
    where = f'--input: {path} line {number}'
    yield where, check_conversation(record, where, field)


def prepare(files: list[str], directory: str, tokenizer: Any, template: Template, *,
            field: str = 'messages', val_fraction: float = 0.01, seed: int = 0,
            forced: int = -1, shard_tokens: int = 2**28, progress: Any = None) -> dict:
  """Renders and tokenizes the conversations of `files` into `directory` (existing, empty)
  as a token dataset (zoo.data.tokens, packed as documents) with a loss mask beside its
  tokens: `{split}-mask-NNNNN.bin`, one byte per token, 1 on the assistant's. Each
  conversation is a document, ended by the tokenizer's end-of-document token (mask 0).
  Conversations go to the validation split by the same hash as text documents; raises
  tokens.EmptyValSplit as tokens.prepare does. Returns the metadata it wrote last."""
  from zoo.data import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
  from zoo.data import tokens  # pylint: disable=import-outside-toplevel
  renderer = Renderer(template)
  vocab_size = tokenizer_lib.vocab_size(tokenizer)
  dtype, eos = tokens.token_dtype(vocab_size), tokenizer_lib.eos_id(tokenizer)
  if eos < 0:
    raise ConfigError('--tokenizer: the tokenizer has no end-of-document token to end each '
                      'conversation with (e.g. <|endoftext|>, </s>, <eos>)')
  writers = {name: tokens.ShardWriter(directory, name, dtype, shard_tokens)
             for name in tokens.SPLITS}
  masks = {name: tokens.ShardWriter(directory, f'{name}-mask', np.uint8, shard_tokens)
           for name in tokens.SPLITS}
  counts = {name: {'tokens': 0, 'documents': 0, 'bytes': 0, 'targets': 0}
            for name in tokens.SPLITS}
  ends = {name: [] for name in tokens.SPLITS}
  sample, index = None, 0
  for path in files:
    for where, messages in read_conversations(path, field):
      name = 'val' if tokens.in_validation(index, val_fraction, seed, forced) else 'train'
      text, spans = renderer.assistant_spans(messages, where)
      ids, mask = encode(tokenizer, text, spans)
      if not mask.any():
        raise ConfigError(f'{where}: no token of the assistant\'s turns is left after the '
                          'chat template; check the template and the messages')
      writers[name].write(np.append(ids, eos))
      masks[name].write(np.append(mask, 0))
      counts[name]['tokens'] += len(ids) + 1
      counts[name]['documents'] += 1
      counts[name]['bytes'] += len(text.encode('utf-8'))
      counts[name]['targets'] += int(mask.sum())
      ends[name].append(counts[name]['tokens'])
      if name == 'val' and sample is None:  # The first held-out reply: each eval's sample.
        first = next(i for i, m in enumerate(messages) if m['role'] == 'assistant')
        prompt, _ = renderer.render(messages[:first], add_generation_prompt=True)
        sample = [int(i) for i in tokenizer.encode(prompt, add_special_tokens=False).ids]
      index += 1
      if progress is not None:
        progress.update(len(text.encode('utf-8')))
        progress.set_postfix_str(f'{index:,} conversations', refresh=False)
  if not counts['val']['documents'] and forced < 0 and index > 1:
    for writer in (*writers.values(), *masks.values()):
      writer.close()
    raise tokens.EmptyValSplit(index)
  for name, fix in (('train', 'give more conversations'),
                    ('val', 'raise --val_fraction or give more conversations')):
    if not counts[name]['documents']:
      raise ConfigError(f'--input: the {name} split is empty ({index} conversations in all, '
                        f'--val_fraction={val_fraction}); {fix}')
  tokenizer.save(os.path.join(directory, 'tokenizer.json'))
  with open(os.path.join(directory, 'chat_template.jinja'), 'w', encoding='utf-8') as f:
    f.write(template.source)
  with open(os.path.join(directory, 'tokenizer_config.json'), 'w', encoding='utf-8') as f:
    json.dump(template.special, f, indent=2)
  np.save(os.path.join(directory, 'token_bytes.npy'), tokenizer_lib.token_bytes(tokenizer))
  for name in tokens.SPLITS:
    np.save(os.path.join(directory, f'{name}-documents.npy'), np.array(ends[name], np.int64))
  stops = [i for t in (template.special.get('eos_token'),) if t
           and (i := tokenizer.token_to_id(t)) is not None]
  meta = {'format': tokens.FORMAT, 'version': tokens.VERSION, 'vocab_size': vocab_size,
          'dtype': dtype.str, 'eos_id': eos, 'tokenizer': {'file': 'tokenizer.json'},
          'token_bytes': 'token_bytes.npy', 'val_fraction': val_fraction, 'seed': seed,
          'inputs': files, **({'val_forced': forced} if forced >= 0 else {}),
          'loss_mask': {'dtype': '|u1'},
          'chat': {'template': 'chat_template.jinja', 'sample_prompt': sample,
                   'stop_ids': sorted(set(stops + [eos]))},
          'splits': {name: {**counts[name], 'shards': writers[name].close(),
                            'mask_shards': masks[name].close(),
                            'documents_file': f'{name}-documents.npy'}
                     for name in tokens.SPLITS}}
  with open(os.path.join(directory, tokens.METADATA), 'w', encoding='utf-8') as f:
    json.dump(meta, f, indent=2)
  return meta
