"""Bad input: a one-line error naming the field, non-zero exit, nothing written."""
import json
import os
import re

import pytest

from conftest import experiment, load_config, run_cli
from zoo import data
from zoo.errors import ConfigError, NonFiniteError, ZooError
from zoo.parallel import sharding
from zoo.run import train

BAD_INPUTS = {
    'unknown model': ({'model.name': 'gpt5'}, r"config\.model\.name: unknown model 'gpt5'; known: mlp, cnn, resnet, vit, transformer_lm, encoder_decoder"),
    'wrong mesh product': ({'mesh.shape': (4, 4)}, r'config\.mesh\.shape: \(4, 4\) needs 16 devices but 8 are present'),
    'two -1': ({'mesh.shape': (-1, -1)}, r'config\.mesh\.shape: \(-1, -1\) has more than one -1'),
    'too many sizes': ({'mesh.shape': (4, 2, 1, 1)}, r'config\.mesh\.shape: .* has 4 entries but mesh\.axes'),
    'rule names missing mesh axis': (
        {'logical_axis_rules': [('act_batch', 'batch'), ('mlp', 'tensor')]},
        r"config\.logical_axis_rules: rule \('mlp', 'tensor'\) names mesh axis 'tensor'"),
    'unknown logical name': ({'logical_axis_rules': [('act_btach', 'batch')]},
                             r"config\.logical_axis_rules: unknown logical axis 'act_btach'"),
    'batch not divisible': ({'mesh.shape': (8, 1), 'train.batch_size': 12},
                            r'config\.train\.batch_size: 12 is not divisible by the 8 shards'),
    'eval batch not divisible': ({'mesh.shape': (8, 1), 'eval.batch_size': 20},
                                 r'config\.eval\.batch_size: 20 is not divisible by the 8 shards'),
    'zero steps': ({'train.steps': 0}, r'config\.train\.steps: must be positive, got 0'),
    'negative learning rate': ({'optimizer.learning_rate': -0.1},
                               r'config\.optimizer\.learning_rate: must be positive, got -0\.1'),
    'model and data disagree': ({'data.name': 'text'}, r"config\.data\.name: model 'mlp' trains on classification"),
    'param does not split': ({'model.hidden_sizes': (63, 64), 'mesh.shape': (2, 4)},
                             r'config\.logical_axis_rules: parameter hidden_0/bias of shape \(63,\) has a dimension of 63 split over 4'),
    'dcn does not divide': ({'mesh.shape': (4, 2), 'mesh.dcn_shape': (3, 1)},
                            r'config\.mesh\.dcn_shape: \(3, 1\) does not divide the mesh shape \(4, 2\)'),
    'dcn slices but one process': ({'mesh.shape': (4, 2), 'mesh.dcn_shape': (2, 1)},
                                   r'config\.mesh\.dcn_shape: \(2, 1\) makes 2 slices but there are 1 processes'),
    'zero width': ({'model.hidden_sizes': (64, 0)}, r'config\.model\.hidden_sizes: sizes must be positive'),
    'negative seed': ({'seed': -1}, r'config\.seed: must be >= 0, got -1'),
    'negative max_batches': ({'eval.max_batches': -1}, r'config\.eval\.max_batches: must be >= 0'),
    'zero heads': ({'model.num_heads': 0}, r'config\.model\.num_heads: sizes must be positive', 'char_lm'),
    'zero seq_len': ({'data.seq_len': 0}, r'config\.data\.seq_len: must be positive', 'char_lm'),
    'missing text file': ({'data.path': '/nonexistent/corpus.txt'},
                          r'config\.data\.path: /nonexistent/corpus\.txt is not a file', 'char_lm'),
    'unknown remat policy': ({'model.remat': 'some'}, r"config\.model\.remat: unknown remat 'some'; known: none, full, dots", 'char_lm'),
    'unknown dtype': ({'model.dtype': 'float16'}, r"config\.model\.dtype: unknown dtype 'float16'; known: float32, bfloat16", 'char_lm'),
    'unknown positions': ({'model.positions': 'alibi'}, r"config\.model\.positions: unknown positions 'alibi'", 'char_lm'),
    'odd rotary head size': ({'model.positions': 'rotary', 'model.num_heads': 64},
                             r'config\.model\.positions: rotary positions need an even head size', 'char_lm'),
    'dropout of one': ({'model.dropout_rate': 1.0}, r'config\.model\.dropout_rate: must be in \[0, 1\), got 1\.0', 'char_lm'),
    'microbatches do not divide': ({'train.microbatches': 5}, r'config\.train\.microbatches: 5: train\.batch_size=128'),
    'unknown seq problem': ({'data.problem': 'multiply'}, r"config\.data\.problem: unknown problem 'multiply'; known: add, reverse, sort", 'seq_sort'),
    'seq longer than max_len': ({'data.digits': 17}, r'config\.model\.max_len: 16 is shorter than the 17 positions', 'seq_sort'),
    'too few held-out examples': ({'data.digits': 2}, r"config\.data\.num_eval: 64 exceeds the 2 distinct held-out 'sort' examples", 'seq_sort'),
    'zero num_eval': ({'data.num_eval': 0}, r'config\.data\.num_eval: must be positive, got 0', 'seq_sort'),
    'resnet features per stage': ({'model.features': (8,)}, r'config\.model\.features: \(8,\) must give one channel count per stage', 'resnet_digits'),
    'vit patch does not divide': ({'model.patch_size': 3}, r'config\.model\.patch_size: 3 does not divide the 8x8 images', 'vit_digits'),
    'profile steps reversed': ({'profile.steps': (4, 2)}, r'config\.profile\.steps: \(4, 2\) must be \(\) or \(a, b\)'),
    'unknown vit pool': ({'model.pool': 'max'}, r"config\.model\.pool: unknown pool 'max'; known: cls, mean", 'vit_digits'),
    'negative prefetch': ({'data.prefetch': -1}, r'config\.data\.prefetch: must be >= 0 \(0: no prefetching\), got -1'),
    'negative peak': ({'perf.peak_flops_per_device': -1.0},
                      r'config\.perf\.peak_flops_per_device: must be >= 0 \(0: look it up or measure it\), got -1\.0'),
    'kv heads do not divide': ({'model.num_kv_heads': 3}, r'config\.model\.num_kv_heads: 3 does not divide model\.num_heads=8', 'char_lm'),
    'unknown norm': ({'model.norm': 'batch'}, r"config\.model\.norm: unknown norm 'batch'; known: layer, rms", 'char_lm'),
    'unknown activation': ({'model.mlp_activation': 'relu'}, r"config\.model\.mlp_activation: unknown mlp_activation 'relu'; known: gelu, gelu_exact, swiglu", 'char_lm'),
    'unknown attention': ({'model.attention': 'flash'}, r"config\.model\.attention: unknown attention 'flash'; known: auto, xla, cudnn", 'char_lm'),
    'zero rope theta': ({'model.rope_theta': 0.0}, r'config\.model\.rope_theta: must be positive, got 0\.0', 'char_lm'),
    # Every device along 'expert' would compute the same rows: char_lm has no experts and its
    # rules none for it (a 'context' axis gets its rules: zoo.parallel.sharding.for_mesh).
    'mesh axis no rule maps': ({'mesh.axes': ('batch', 'expert', 'model'), 'mesh.shape': (2, 2, 2)},
                               r"config\.mesh\.axes: mesh axis 'expert' \(2 devices\) is named by no "
                               r'rule in logical_axis_rules, so every device along it would compute '
                               r'the same rows', 'char_lm'),
    'init_from missing': ({'checkpoint.init_from': '/nonexistent/run'},
                          r'config\.checkpoint\.init_from: /nonexistent/run is not a directory'),
}


@pytest.mark.parametrize('case', sorted(BAD_INPUTS))
def test_bad_config_names_the_field_and_writes_nothing(case, tmp_path, devices):
  del devices
  overrides, message, *name = BAD_INPUTS[case]
  workdir = tmp_path / 'run'
  with pytest.raises(ZooError, match=message):
    train.train_and_evaluate(load_config(*(name or ['mlp_digits']), **overrides), str(workdir))
  assert not workdir.exists()


def test_text_too_short_for_seq_len(tmp_path, devices):
  del devices
  (tmp_path / 'tiny.txt').write_text('hello world, ' * 20)
  with pytest.raises(ConfigError, match=r'config\.data\.path: its last 10% .* shorter than'):
    train.train_and_evaluate(load_config('char_lm', **{'data.path': str(tmp_path / 'tiny.txt')}),
                             str(tmp_path / 'run'))
  assert not (tmp_path / 'run').exists()


def test_a_plan_needs_only_the_texts_shapes(tmp_path):
  """--dry_run compiles for shapes alone: a text too short for one window (above) is
  repeated until each split holds one (a pod's 131k-token plan on the shipped text)."""
  (tmp_path / 'tiny.txt').write_text('hello world, ' * 20)
  config = load_config('char_lm', **{'data.path': str(tmp_path / 'tiny.txt')})
  dataset = data.load(config.data, config.seed, plan=True)
  shape = (2, config.data.seq_len)
  assert dataset.train_batch(0, 2, slice(0, 2))['inputs'].shape == shape
  assert next(iter(dataset.eval_batches(2, slice(0, 2))))['targets'].shape == shape


def test_batch_axes_follow_flax_first_matching_rule():
  config = load_config('mlp_digits', **{
      'logical_axis_rules': sharding.standard_rules() + (('act_batch', 'model'),)})
  assert sharding.batch_mesh_axes(config.logical_axis_rules) == ('batch',)


def test_unwritable_workdir(tmp_path, devices):
  del devices
  blocker = tmp_path / 'file'
  blocker.write_text('not a directory')
  with pytest.raises(ConfigError, match=r'--workdir: .* cannot be written'):
    train.train_and_evaluate(load_config('mlp_digits'), str(blocker / 'run'))
  assert blocker.read_text() == 'not a directory'


def test_existing_workdir_is_left_untouched_on_bad_input(tmp_path, devices):
  del devices
  (tmp_path / 'keep.txt').write_text('precious')
  with pytest.raises(ConfigError):
    train.train_and_evaluate(load_config('mlp_digits', **{'train.steps': -3}), str(tmp_path))
  assert sorted(os.listdir(tmp_path)) == ['keep.txt']


@pytest.mark.parametrize('flag,message', [
    ('--config.mesh.shape=(3,3)', 'zoo: error: config.mesh.shape: (3, 3) needs 9 devices but 8 are present'),
    ('--config.model.name=resnet9000', "zoo: error: config.model.name: unknown model 'resnet9000'"),
    ('--device_memory_gib=8', 'zoo: error: --device_memory_gib goes with --dry_run'),
])
def test_cli_prints_one_line_and_exits_nonzero(flag, message, tmp_path):
  workdir = tmp_path / 'run'
  result = run_cli(f'--config={experiment("mlp_digits")}:smoke', f'--workdir={workdir}', flag)
  assert result.returncode != 0
  assert 'Traceback' not in result.stderr
  assert result.stderr.strip().splitlines()[-1].startswith(message), result.stderr[-2000:]
  assert not workdir.exists()


# every=1 checks each step before its save; with saves only at the end, log_every=100 is
# checked at the first eval (step 30) and log_every=5 at step 5, a step late (after step 6
# is dispatched: the `pending` path).
@pytest.mark.parametrize('every,log_every', [(1, 100), (1000, 100), (1000, 5)])
def test_non_finite_loss_stops_with_the_step_and_is_never_saved(every, log_every, tmp_path,
                                                                   devices):
  del devices
  config = load_config('mlp_digits', **{
      'optimizer.name': 'sgd', 'optimizer.learning_rate': 1e12, 'optimizer.grad_clip_norm': 0.0,
      'optimizer.warmup_steps': 0, 'optimizer.schedule': 'constant',
      'train.log_every_steps': log_every, 'checkpoint.every_steps': every})
  with pytest.raises(NonFiniteError,
                     match=r'non-finite train/(loss|param_norm) \S+ at step (\d+)') as error:
    train.train_and_evaluate(config, str(tmp_path))
  bad_step = int(re.search(r'at step (\d+)', str(error.value)).group(1))
  if log_every == 5:
    assert bad_step == 5
  saved = [int(s) for s in os.listdir(tmp_path / 'checkpoints') if s.isdigit()]
  assert all(s < bad_step for s in saved), (saved, bad_step)


def test_unsupported_remote_workdir_is_rejected_not_written_locally(tmp_path, devices,
                                                                    monkeypatch):
  del devices  # gs:// workdirs work (gcs_test); other schemes are refused by name.
  monkeypatch.chdir(tmp_path)  # os.path would turn s3://b/run into ./s3:/b/run.
  with pytest.raises(ConfigError, match=r'--workdir: s3://b/run: only gs:// buckets and local '
                                        r'paths are supported'):
    train.train_and_evaluate(load_config('mlp_digits'), 's3://b/run')
  assert not list(tmp_path.iterdir())


def _documented_model_keys():
  """The `model.X` keys of docs/configuration.md's Transformer switches and family rows."""
  text = open(os.path.join(os.path.dirname(__file__), '..', 'docs', 'configuration.md')).read()
  switches = text[text.index('**Transformer switches**'):]
  switches = switches[:switches.index('\n\n', switches.index('| key |'))]
  keys = set(re.findall(r'`model\.([a-z_0-9]+)`', switches))
  keys |= set(re.findall(r'`(rope_[a-z_]+)`', switches))  # Named in the rope_scaling row.
  keys |= {'num_layers', 'd_model', 'num_heads', 'mlp_dim', 'max_len'}  # transformer_lm's row.
  return keys - {'name'}


def _parse_flags(argv):
  """argv through absl and ml_collections' --config flag, as `python -m zoo.main` parses it."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel
  values, argv = flags.FlagValues(), ['zoo.main'] + argv
  holder = config_flags.DEFINE_config_file('config', None, 'test', flag_values=values,
                                           sys_argv=argv)
  values(argv)
  return holder.value


@pytest.mark.parametrize('name', ['char_lm', 'bpe_lm', 'finetune_lm', 'moe_lm'])
def test_every_documented_model_key_is_settable_on_every_lm_experiment(name, tmp_path):
  """docs/configuration.md's model keys: each one set on the command line of each language-
  model experiment (finetune_lm's model is an imported workdir's config.json, here one that
  names only the sizes) reaches the config; `rope_theta` on char_lm failed before."""
  arg = 'smoke'
  if name == 'finetune_lm':
    (tmp_path / 'config.json').write_text(json.dumps({'model': {
        'name': 'transformer_lm', 'num_layers': 2, 'd_model': 64, 'num_heads': 4, 'mlp_dim': 128,
        'max_len': 32, 'vocab_size': 300}}))
    arg = f'{tmp_path},smoke'
  keys = _documented_model_keys()
  assert {'rope_theta', 'attention', 'sliding_window', 'final_softcap', 'lora'} <= keys
  config = load_config(name, arg)
  missing = sorted(k for k in keys if k not in config.model)
  assert not missing, f'{name} has no config.model field for {missing}'
  new = {'rope_theta': '500000', 'sliding_window': '16', 'final_softcap': '30.0', 'qk_norm': 'True',
         'norm': 'rms', 'lora.rank': '4', 'head_dim': '16', 'rope_original_max_len': '64'}
  parsed = _parse_flags([f'--config={experiment(name)}:{arg}'] +
                        [f'--config.model.{k}={v}' for k, v in new.items()])
  assert parsed.model.rope_theta == 500000 and parsed.model.sliding_window == 16
  assert parsed.model.final_softcap == 30.0 and parsed.model.qk_norm is True
  assert parsed.model.norm == 'rms' and parsed.model.lora.rank == 4
  assert parsed.model.head_dim == 16 and parsed.model.rope_original_max_len == 64
  # Keys left alone build the model the module's defaults build.
  from zoo import models  # pylint: disable=import-outside-toplevel
  built = models.build(config.model, vocab_size=300, max_len=32)
  for key in keys - {'lora', 'num_kv_heads', 'vocab_size'} - set(new):
    assert getattr(built, key) == config.model[key], key


def test_a_switch_set_on_the_command_line_needs_no_other(tmp_path):
  """char_lm with --config.model.mlp_activation=swiglu (and Llama's other switches) trains:
  the LoRA targets model_config lists for gelu are unused at rank 0, not refused."""
  result = run_cli(f'--config={experiment("char_lm")}:smoke', f'--workdir={tmp_path}',
                   '--config.model.mlp_activation=swiglu', '--config.model.norm=rms',
                   '--config.model.positions=rotary', '--config.model.rope_theta=500000',
                   '--config.train.steps=2', devices=2)
  assert result.returncode == 0, result.stderr[-2000:]
