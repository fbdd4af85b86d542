r"""Hugging Face weights in and out: `python -m zoo.convert import|export`.

    python -m zoo.convert import --hf_dir=path/to/hf_model --workdir=runs/imported
    python -m zoo.sample --workdir=runs/imported --prompt='Hello' --num_tokens=50
    python -m zoo.convert export --workdir=runs/finetuned --hf_dir=path/to/out

`import` reads a local HF model directory (config.json; model.safetensors, or shards with
model.safetensors.index.json; tokenizer.json for language models) with the `safetensors`
library, no torch, and writes a zoo workdir: config.json (the model as zoo fields),
tokenizer.json, and a checkpoint of the params at step 0 that `zoo.sample` runs and
`checkpoint.init_from` starts from. Each HF tensor is read once and each device receives
only its own shards (jax.make_array_from_callback over numpy views of the tensor), so the
host holds one tensor at a time beside the shards. Another architecture is refused with
the list of supported ones, a supported one with a switch zoo lacks by naming the switch.
Names, shapes and the tokenizer's vocabulary are checked before anything is written.

`export` writes a zoo run's newest params as a HF directory that `transformers` loads:
config.json, model.safetensors (or shards of --max_shard_gib with an index), and the
tokenizer.json of the run (its own, or its token dataset's). A LoRA run's adapters are
merged into the weights; with --peft they are written alone, as a PEFT adapter directory:

    python -m zoo.convert export --workdir=runs/lora --hf_dir=out/adapter --peft

Supported: GPT-2, Llama (1-3), Mistral, Qwen2/2.5, Qwen3, Gemma (1-3), the mixtures of
experts Mixtral, Qwen2-MoE and Qwen3-MoE, and the ViT (zoo.hf.layouts). Neither direction
holds a second copy of the weights on the host: import reads one tensor at a time (a stack
of experts, each device's experts only), export writes one shard at a time.
"""
from absl import flags

from zoo import shell
from zoo.errors import ZooError
from zoo.hf.transfer import export_model, import_model

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command line's flags: defined only when this module runs as a program, so that
  its functions can be imported beside other programs' (absl flags are global)."""
  flags.DEFINE_string('hf_dir', None, 'The Hugging Face model directory: read by import, '
                      'written by export.')
  flags.DEFINE_string('workdir', None, 'The zoo workdir: written by import, read by export.')
  flags.DEFINE_string('mesh_shape', '', "import: the mesh to place the params on, e.g. '1,8'. "
                      "Empty: every device on 'model' (axes the params cannot split over are "
                      'replicated).')
  flags.DEFINE_float('max_shard_gib', 4.0, 'export: the largest safetensors file.')
  flags.DEFINE_bool('peft', False, 'export: write a LoRA run\'s adapters alone, as a PEFT '
                    'adapter directory (without it they are merged into the weights).')
  flags.mark_flags_as_required(['hf_dir', 'workdir'])


def main(argv: list[str]) -> None:
  if len(argv) != 2 or argv[1] not in ('import', 'export'):
    raise ZooError('give import or export: python -m zoo.convert import --hf_dir=DIR '
                   '--workdir=DIR, or export --workdir=DIR --hf_dir=DIR')
  if not 0 < FLAGS.max_shard_gib < 2**20:  # (NaN fails too.)
    raise ZooError(f'--max_shard_gib: must be a positive number of GiB, got {FLAGS.max_shard_gib}')
  shell.start_devices(per_core=False)  # One CPU device unless --cpu_devices, as before.
  if argv[1] == 'import':
    import_model(FLAGS.hf_dir, FLAGS.workdir, FLAGS.mesh_shape)
  else:
    export_model(FLAGS.workdir, FLAGS.hf_dir, int(FLAGS.max_shard_gib * 2**30), FLAGS.peft)


if __name__ == '__main__':
  shell.define_flags()
  define_flags()
  shell.run(main)
