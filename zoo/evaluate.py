r"""Runs lm-evaluation-harness tasks on a language-model run: `python -m zoo.evaluate`.

    python -m zoo.evaluate --workdir=runs/bpe_lm --tasks=my_task --include_path=path/to/tasks
    python -m zoo.evaluate --workdir=runs/imported --tasks=hellaswag,lambada_openai --limit=200

Scores the run's newest checkpoint (trained or imported) through EleutherAI's harness
(zoo.run.harness: loglikelihood, loglikelihood_rolling, generate_until through the
key/value cache), sharded on the devices present (--mesh_shape; the default puts every
device on 'model'), and prints the harness's table; --output also writes its results as
JSON. Tasks are the harness's (which fetch their data from the Hugging Face Hub) or your
own, defined in YAML files under --include_path over local files. Needs the `eval`
extra: `pip install -e '.[eval]'`.
"""
import json

from absl import flags
import jax

from zoo import shell
from zoo.errors import ConfigError, ZooError
from zoo.store import storage

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command line's flags (defined only when this module runs as a program)."""
  flags.DEFINE_string('workdir', None, 'Workdir of a language-model run (trained or imported).')
  flags.DEFINE_list('tasks', None, 'Harness task (or group) names, comma-separated.')
  flags.DEFINE_string('include_path', '', 'A directory of task YAML files of your own.')
  flags.DEFINE_float('limit', None, 'At most this many examples per task (below 1: a fraction).')
  flags.DEFINE_integer('num_fewshot', None, "Few-shot examples per prompt (default: the task's).")
  flags.DEFINE_integer('batch_size', 16, 'Rows of max_len tokens scored per call.')
  flags.DEFINE_integer('max_gen_toks', 256, 'generate_until: tokens per answer, unless the task '
                       'says.')
  flags.DEFINE_string('mesh_shape', '', "Mesh over the run's mesh axes, e.g. '4,2'. Empty: every "
                      "device on 'model' if the parameters split that way, else one device.")
  flags.DEFINE_integer('seed', 0, 'Seed of few-shot sampling and of sampled generations.')
  flags.DEFINE_string('output', '', "Also write the harness's results here as JSON.")
  flags.DEFINE_bool('log_samples', False, 'With --output: also every request and response.')
  flags.mark_flags_as_required(['workdir', 'tasks'])


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise ZooError(f'unexpected arguments {argv[1:]}')
  if not FLAGS.tasks:
    raise ConfigError('--tasks: is empty; give harness task names, comma-separated')
  if FLAGS.limit is not None and not 0 < FLAGS.limit < float('inf'):
    raise ConfigError(f'--limit: must be a positive number (below 1: a fraction of each task), '
                      f'got {FLAGS.limit}')
  if FLAGS.num_fewshot is not None and FLAGS.num_fewshot < 0:
    raise ConfigError(f'--num_fewshot: must be >= 0, got {FLAGS.num_fewshot}')
  shell.start_devices(per_core=False)
  from zoo.run import harness  # pylint: disable=import-outside-toplevel  # Needs .[eval].
  results = harness.evaluate(
      FLAGS.workdir, FLAGS.tasks, FLAGS.include_path, FLAGS.limit, FLAGS.num_fewshot,
      FLAGS.batch_size, FLAGS.mesh_shape, FLAGS.max_gen_toks, FLAGS.seed, FLAGS.log_samples)
  if jax.process_index() == 0:
    from lm_eval.utils import make_table  # pylint: disable=import-outside-toplevel
    print(make_table(results))
    if FLAGS.output:
      storage.write_text(FLAGS.output, json.dumps(results, indent=2, default=str))


if __name__ == '__main__':
  shell.define_flags()
  define_flags()
  shell.run(main)
