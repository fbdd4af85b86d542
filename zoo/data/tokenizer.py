"""Tokenizers of token datasets, all Hugging Face `tokenizers` objects saved as tokenizer.json.

- `bytes`: one token per UTF-8 byte (id = the byte's value) plus an end-of-document token:
  257 symbols, no merges; any text encodes, and a byte model compares with a character one.
- `bpe`: a byte-level BPE (GPT-2's scheme) trained on the corpus to a chosen vocabulary.
- a path to any `tokenizer.json` (e.g. a released model's).

`token_bytes` gives each id's length in UTF-8 bytes, so that eval can report bits per byte,
the measure that compares models whatever their tokenizer.
"""
import json
import os
import re
from typing import Callable, Iterable, Iterator

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from zoo.errors import ConfigError
from zoo.store import storage

EOS = '<|endoftext|>'
BOS = ('<|begin_of_text|>', '<s>', '<bos>', '<|startoftext|>')  # Known beginnings, Llama's first.
KINDS = ('bytes', 'bpe')  # Or a path to a tokenizer.json.


def _byte_alphabet() -> dict[int, str]:
  """GPT-2's byte -> printable character map, which byte-level tokenizers spell tokens in."""
  printable = (list(range(ord('!'), ord('~') + 1)) + list(range(ord('¡'), ord('¬') + 1))
               + list(range(ord('®'), ord('ÿ') + 1)))
  chars, extra = {}, 0
  for b in range(256):
    if b in printable:
      chars[b] = chr(b)
    else:
      chars[b] = chr(256 + extra)
      extra += 1
  return chars


def bytes_tokenizer() -> tokenizers.Tokenizer:
  """One token per byte, id = byte value; the end-of-document token is id 256."""
  alphabet = _byte_alphabet()
  vocab = {alphabet[b]: b for b in range(256)}
  vocab[EOS] = 256
  tokenizer = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.add_special_tokens([EOS])
  return tokenizer


MAX_BPE_VOCAB = 2**22


def train_bpe(documents: Iterable[str], vocab_size: int) -> tokenizers.Tokenizer:
  """A byte-level BPE trained on `documents`: every byte is in the vocabulary (nothing is
  ever unknown), the end-of-document token is id 0, merges fill the rest."""
  if vocab_size < 257:
    raise ConfigError(f'--vocab_size: {vocab_size} is too small for a byte-level BPE (256 bytes '
                      'and the end-of-document token); use at least 257, e.g. 8192')
  if vocab_size > MAX_BPE_VOCAB:  # The trainer allocates ~70 bytes per entry up front.
    raise ConfigError(f'--vocab_size: {vocab_size} is more than a BPE vocabulary zoo trains '
                      f'({MAX_BPE_VOCAB:,}; the largest in use are ~262k); e.g. 8192 to 131072')
  tokenizer = tokenizers.Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tokenizer.train_from_iterator(documents, trainer)
  return tokenizer


def resolve(spec: str) -> str:
  """The tokenizer.json that --tokenizer names: the file, a model's directory, or a zoo
  workdir (its own, or the token dataset it trained on)."""
  if not os.path.isdir(spec):
    return spec
  own = os.path.join(spec, 'tokenizer.json')
  if os.path.isfile(own) or not os.path.isfile(os.path.join(spec, 'config.json')):
    return own
  with open(os.path.join(spec, 'config.json'), encoding='utf-8') as f:
    data_path = (json.load(f).get('data') or {}).get('path') or ''
  return storage.join(data_path, 'tokenizer.json') if data_path else own


def load(path: str, field: str = '--tokenizer',
         fix: str = 'give a tokenizer.json that `tokenizers.Tokenizer.from_file` reads, or '
                    '"bytes" or "bpe"') -> tokenizers.Tokenizer:
  """A tokenizer.json; ConfigError naming `field` and `fix` if it is missing or not one."""
  if not storage.is_file(path):
    raise ConfigError(f'{field}: {path} is not a file; {fix}')
  try:
    if storage.is_remote(path):
      return tokenizers.Tokenizer.from_str(storage.read_text(path))
    return tokenizers.Tokenizer.from_file(path)
  except Exception as e:  # pylint: disable=broad-except  # The Rust side raises plain Exception.
    reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    raise ConfigError(f'{field}: {path} is not a valid tokenizer.json ({reason}); {fix}') from None


def vocab_size(tokenizer: tokenizers.Tokenizer) -> int:
  """One more than the largest id (a tokenizer's ids may leave gaps)."""
  return max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1


def eos_id(tokenizer: tokenizers.Tokenizer) -> int:
  """The id that ends a document: the tokenizer's own end token if it has a known one, else
  -1 (documents are then concatenated with nothing between them)."""
  for name in (EOS, '</s>', '<|end_of_text|>', '<eos>', '[SEP]'):
    if (i := tokenizer.token_to_id(name)) is not None:
      return i
  return -1


def codec(tokenizer: tokenizers.Tokenizer) -> tuple[Callable, Callable]:
  """(ids -> text, text -> int32 ids without added special tokens): a Dataset's decode and
  encode."""
  def decode(ids):
    return tokenizer.decode([int(i) for i in ids])

  def encode(text):
    return np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, np.int32)
  return decode, encode


def document_start(tokenizer: tokenizers.Tokenizer) -> list[int]:
  """What a text prompt starts with, as a document did in training: the tokenizer's
  beginning-of-sequence token if it has a known one, else its end-of-document token (the
  token before each packed document in zoo's token datasets; lm-evaluation-harness and
  zoo.data.choice start a context with it too), else nothing."""
  for name in BOS:
    if (i := tokenizer.token_to_id(name)) is not None:
      return [i]
  eos = eos_id(tokenizer)
  return [eos] if eos >= 0 else []


def _is_byte_level(tokenizer: tokenizers.Tokenizer) -> bool:
  config = json.loads(tokenizer.to_str())
  parts = [config.get('pre_tokenizer') or {}, config.get('decoder') or {}]
  for part in list(parts):
    parts += part.get('pretokenizers', []) + part.get('decoders', [])
  return any(p.get('type') == 'ByteLevel' for p in parts)


def token_bytes(tokenizer: tokenizers.Tokenizer) -> np.ndarray:
  """[vocab] int32: the UTF-8 bytes each token stands for; 0 for special tokens.

  Byte-level tokenizers spell a token with one character per byte. Others (SentencePiece
  style) use '▁' for a space and `<0xNN>` for byte fallback.
  """
  vocab = vocab_size(tokenizer)
  special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
  to_byte = {c: b for b, c in _byte_alphabet().items()}
  byte_level = _is_byte_level(tokenizer)
  lengths = np.zeros(vocab, np.int32)
  for i in range(vocab):
    token = tokenizer.id_to_token(i)
    if token is None or i in special:
      continue
    if byte_level and all(c in to_byte for c in token):
      lengths[i] = len(token)
    elif re.fullmatch(r'<0x[0-9A-Fa-f]{2}>', token):
      lengths[i] = 1
    else:
      lengths[i] = len(token.replace('\u2581', ' ').encode('utf-8'))
  return lengths


def encode_documents(tokenizer: tokenizers.Tokenizer, documents: list[str],
                     eos: int) -> Iterator[np.ndarray]:
  """Each document's ids followed by `eos` (if >= 0), encoded in parallel over the cores.

  Special tokens written in a document ('<|endoftext|>' in a web page) are encoded as the
  text they are, so only the end of a document is ever `eos`.
  """
  tokenizer.encode_special_tokens = True
  for encoding in tokenizer.encode_batch_fast(documents, add_special_tokens=False):
    ids = np.asarray(encoding.ids, np.int64)
    yield np.append(ids, eos) if eos >= 0 else ids
