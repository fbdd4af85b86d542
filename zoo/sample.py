r"""Generates text from a language-model run: `python -m zoo.sample --workdir=DIR`.

    python -m zoo.sample --workdir=runs/char_lm --prompt='The ' --num_tokens=300
    python -m zoo.sample --workdir=runs/imported --prompt='Hello' --prompt='The sea' \
        --num_tokens=50 --top_p=0.9 --format=json

Reads the run's config.json and its newest checkpoint (params only) onto the devices
present, whatever mesh trained it, and prints each sample (prompt + continuation) to
stdout, or with --format=json one object per sample: {"prompt", "text" (the continuation),
"prompt_ids", "ids" (the generated ids)}; logs go to stderr. Prompts are encoded and
samples decoded by the run's data (characters, or a token dataset's tokenizer; an imported
model's tokenizer.json). Several prompts, times --num_samples, form one batch.

Decoding prefills the prompts into a key/value cache and then generates one token per
step (zoo.models.decode); when prompt + new tokens exceed the model's max_len it recomputes the
window per token instead, the context sliding (equal-length prompts only). An empty prompt
starts from a newline (token 0 if the vocabulary has none), which is not printed. The
default mesh puts every device on the 'model' axis; if the parameters do not split that
way, sampling runs on one device. The same --seed gives the same text on any mesh. For
`npz` token data (no characters), prompts and output are token ids separated by spaces.
"""
import json

from absl import flags
import jax

from zoo import shell
from zoo.errors import ZooError
from zoo.run.sampling import DECODINGS, generate

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command line's flags: defined only when this module runs as a program, so that
  its functions can be imported beside other programs' (absl flags are global)."""
  flags.DEFINE_string('workdir', None, 'Workdir of a language-model run (trained or imported).')
  flags.DEFINE_multi_string(
      'prompt', [''], 'Text to continue (empty: start from a newline); repeat for several.')
  flags.DEFINE_integer('num_tokens', None, 'Tokens to generate per sample.')
  flags.DEFINE_integer('num_chars', 200, 'Tokens (characters) per sample, if no --num_tokens.')
  flags.DEFINE_float('temperature', 0.8, 'Softmax temperature; 0 is greedy.')
  flags.DEFINE_integer('top_k', 0, 'Sample among the k likeliest tokens; 0: all.')
  flags.DEFINE_float('top_p', 1.0, 'Sample among the likeliest tokens whose probability reaches '
                     'p (nucleus sampling); 1: all.')
  flags.DEFINE_integer('num_samples', 1, 'Samples per prompt, generated as one batch.')
  flags.DEFINE_integer('seed', 0, 'Sampling seed: the same seed gives the same text.')
  flags.DEFINE_enum('format', 'text', ['text', 'json'],
                    'text: each sample as text; json: one JSON object per sample.')
  flags.DEFINE_enum('decoding', 'auto', list(DECODINGS), 'auto: the key/value cache when the '
                    'sample fits max_len, else recompute the window per token.')
  flags.DEFINE_string('mesh_shape', '', "Mesh over the run's mesh axes, e.g. '1,8' or '-1,1'. "
                      "Empty: every device on 'model' if the parameters split that way, else one "
                      'device.')
  flags.mark_flags_as_required(['workdir'])


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise ZooError(f'unexpected arguments {argv[1:]}')
  shell.start_devices(per_core=False)  # One CPU device unless --cpu_devices, as before.
  num_tokens = FLAGS.num_chars if FLAGS.num_tokens is None else FLAGS.num_tokens
  samples = generate(FLAGS.workdir, FLAGS.prompt, num_tokens, FLAGS.temperature,
                     FLAGS.top_k, FLAGS.top_p, FLAGS.num_samples, FLAGS.seed,
                     FLAGS.mesh_shape, FLAGS.decoding)
  if jax.process_index() == 0:
    for i, s in enumerate(samples):
      if FLAGS.format == 'json':
        print(json.dumps({k: s[k] for k in ('prompt', 'text', 'prompt_ids', 'ids')}))
        continue
      if len(samples) > 1:
        print(('\n' if i else '') + f'=== sample {i + 1} of {len(samples)} ===')
      print(s['sample'])


if __name__ == '__main__':
  shell.define_flags()
  define_flags()
  shell.run(main)
