r"""Builds datasets that training reads per process: `python -m zoo.prepare text|chat|preference|prompts|images`.

    python -m zoo.prepare text --input='corpus/*.txt' --output=data/corpus --tokenizer=bpe \
        --vocab_size=8192
    python -m zoo.prepare text --input=docs.jsonl --field=text --output=data/docs --tokenizer=bytes
    python -m zoo.prepare text --input=part-0.parquet --column=text --output=data/pq \
        --tokenizer=path/to/tokenizer.json
    python -m zoo.prepare chat --input=conversations.jsonl --output=data/chat \
        --tokenizer=runs/imported
    python -m zoo.prepare preference --input=pairs.jsonl --output=data/pairs \
        --tokenizer=runs/imported
    python -m zoo.prepare prompts --input=prompts.jsonl --output=data/prompts \
        --tokenizer=runs/imported
    python -m zoo.prepare images --input=path/to/imagefolder --output=data/images

`text` writes a token dataset (zoo.data.tokens: `--config.data.name=tokens`), `chat` one of
conversations rendered with the model's chat template and a loss mask on the assistant's
tokens (zoo.data.chat), `preference` pairs of completions for DPO (zoo.data.preference:
`--config.data.name=preference`), `prompts` prompts for GRPO with the fields their rewards
read (zoo.data.prompts: `--config.data.name=prompts`), `images` a record dataset (zoo.data.records:
`--config.data.name=records`). The output appears whole
or not at all: it is written into `OUTPUT.partial-<pid>` and renamed when complete, so an
interrupted prepare leaves nothing that training accepts. An existing OUTPUT is replaced
only with --overwrite. A progress bar on stderr shows bytes (and images), rate and ETA.
"""
from absl import flags

from zoo import shell
from zoo.data import writer
from zoo.errors import ZooError

_INPUT = flags.DEFINE_multi_string(
    'input', [], 'text: files or globs (repeat the flag for several; quote globs); .jsonl and '
    '.parquet hold one document per line or row, any other file is one document. images: the '
    'root of an image-folder tree (ROOT/train/<class>/*.png|jpg, optional ROOT/val/<class>/).')
_EXCLUDE = flags.DEFINE_multi_string(
    'exclude', [], "text: leave out the files that match this glob, e.g. '*/site-packages/*'.")
_SKIP_UNDECODABLE = flags.DEFINE_bool(
    'skip_undecodable', False, 'text: leave out (and list) the text files that are not UTF-8, '
    'instead of stopping at the first.')
_OUTPUT = flags.DEFINE_string('output', None, 'The dataset directory to write.')
_OVERWRITE = flags.DEFINE_bool('overwrite', False, 'Replace an existing --output.')
_VAL_FRACTION = flags.DEFINE_float(
    'val_fraction', 0.01, 'Fraction of documents (text), pairs (preference), or of training images when there is no '
    'val/ folder (images), held out for validation.')
_SEED = flags.DEFINE_integer('seed', 0, 'Seeds the train/validation split.')
_TOKENIZER = flags.DEFINE_string(
    'tokenizer', 'bytes', "text: 'bytes' (one token per UTF-8 byte), 'bpe' (a byte-level BPE "
    'trained on the training documents), a tokenizer.json, or the directory of a model or a zoo '
    'run that has one. chat, preference and prompts: the model\'s directory (tokenizer.json and its chat '
    'template), its zoo workdir, or its tokenizer.json.')
_CHAT_TEMPLATE = flags.DEFINE_string(
    'chat_template', '', 'chat: a Jinja chat template file, instead of the one beside the '
    'tokenizer (chat_template.jinja or tokenizer_config.json).')
_VOCAB_SIZE = flags.DEFINE_integer('vocab_size', 8192,
                                   "text: the BPE's vocabulary (--tokenizer=bpe).")
_FIELD = flags.DEFINE_string('field', 'text', 'text: the JSON Lines field that holds a document '
                             "(chat: the conversation's, 'messages' unless given).")
_COLUMN = flags.DEFINE_string('column', 'text', 'text: the Parquet column that holds a document.')
_SHARD_TOKENS = flags.DEFINE_integer('shard_tokens', 2**28, 'text: tokens per shard file.')
_IMAGE_SIZE = flags.DEFINE_integer(
    'image_size', 0, 'images: resize the shorter side to this and crop the centre square '
    '(needed when the images differ in size); 0: keep them as they are.')
_SHARD_EXAMPLES = flags.DEFINE_integer('shard_examples', 4096, 'images: images per record file.')
_STORE = flags.DEFINE_enum(
    'store', 'auto', ['auto', 'pixels', 'file'], 'images: what a record holds: its pixels '
    '(no decoding when read), its PNG/JPEG file (smaller, decoded when read), or auto: pixels '
    'for images of at most 64x64x3 bytes.')
flags.mark_flags_as_required(['output'])


def main(argv: list[str]) -> None:
  if len(argv) != 2:
    raise ZooError(f'give one kind, text or images (or chat, preference, prompts): python -m '
                   'zoo.prepare text|chat|preference|prompts|images --input=... --output=... '
                   f'(got {argv[1:]})')
  try:
    writer.run(argv[1], writer.Options(
        inputs=tuple(_INPUT.value), output=_OUTPUT.value, exclude=tuple(_EXCLUDE.value),
        skip_undecodable=_SKIP_UNDECODABLE.value, overwrite=_OVERWRITE.value,
        val_fraction=_VAL_FRACTION.value, seed=_SEED.value, tokenizer=_TOKENIZER.value,
        vocab_size=_VOCAB_SIZE.value, field=_FIELD.value, column=_COLUMN.value,
        shard_tokens=_SHARD_TOKENS.value, image_size=_IMAGE_SIZE.value,
        shard_examples=_SHARD_EXAMPLES.value, store=_STORE.value,
        chat_template=_CHAT_TEMPLATE.value))
  except OSError as e:  # A full disk, a permission taken away, a file gone meanwhile.
    raise ZooError(f'{e.filename or "--output"}: {e.strerror or e}; nothing was written') from None
  except KeyboardInterrupt:
    raise ZooError('interrupted; nothing was written') from None


if __name__ == '__main__':
  shell.define_flags(devices=False)
  shell.run(main)
