"""Golden sharding tables, shard shapes, activation constraints and batch rows."""
import json
import os
import re

import jax
import pytest

from conftest import load_config
from zoo import data
from zoo.data import feed
from zoo.parallel import sharding
from zoo.run import setup, steps

GOLDEN_DIR = os.path.join(os.path.dirname(__file__), 'golden')
# Regenerate with ZOO_UPDATE_GOLDEN=1 pytest tests/sharding_test.py, only after a deliberate
# change of a model's parameters or of the standard rules; review the diff.
UPDATE = os.environ.get('ZOO_UPDATE_GOLDEN') == '1'
# Golden name -> (experiment, overrides) at smoke size.
MODELS = {
    'mlp': ('mlp_digits', {}),
    'cnn': ('cnn_digits', {}),
    'resnet': ('resnet_digits', {}),
    'vit': ('vit_digits', {}),
    'transformer_lm': ('char_lm', {}),
    'transformer_lm_scan': ('char_lm', {'model.scan_layers': True, 'model.positions': 'rotary'}),
    'encoder_decoder': ('seq_sort', {}),
    # Published layouts (zoo.hf.layouts): GPT-2, Llama with grouped-query attention, HF's ViT.
    'transformer_lm_gpt2': ('char_lm', {'model.use_bias': True, 'model.tie_embeddings': True,
                                        'model.norm_epsilon': 1e-5}),
    'transformer_lm_llama': ('char_lm', {'model.positions': 'rotary', 'model.norm': 'rms',
                                         'model.mlp_activation': 'swiglu', 'model.num_kv_heads': 2}),
    'vit_hf': ('vit_digits', {'model.use_bias': True, 'model.mlp_activation': 'gelu_exact'}),
}


def _setup(model_name, mesh_shape=(4, 2)):
  """The experiment's Setup (what the trainer builds) and its first global train batch."""
  experiment, overrides = MODELS[model_name]
  config = load_config(experiment, **{'mesh.shape': mesh_shape, **overrides})
  dataset = data.load(config.data, config.seed)
  return setup.build(config, dataset), dataset.train_batch(0, config.train.batch_size, slice(None))


@pytest.mark.parametrize('model_name', sorted(MODELS))
def test_golden_param_table(model_name, devices):
  del devices
  s, _ = _setup(model_name)
  rows = s.param_table()  # Parameters, then BatchNorm statistics.
  table = {r['path']: {k: r[k] for k in ('shape', 'logical_axes', 'partition_spec', 'shard_shape')}
           for r in rows}
  path = os.path.join(GOLDEN_DIR, f'{model_name}.json')
  if UPDATE:
    with open(path, 'w', encoding='utf-8') as f:  # One parameter per line: readable diffs.
      f.write('{\n' + ',\n'.join(f'  {json.dumps(k)}: {json.dumps(table[k])}' for k in sorted(table))
              + '\n}\n')
  with open(path, encoding='utf-8') as f:
    golden = json.load(f)
  assert table == golden, (
      f'{model_name} parameters no longer match {path} (smoke size, mesh (4,2), standard rules). '
      'Update the golden file only for a deliberate change of the model or the rules.')


@pytest.mark.parametrize('model_name', sorted(MODELS))
def test_state_is_created_in_its_shards(model_name, devices):
  del devices
  s, _ = _setup(model_name)
  with s.scope():
    state = s.create_state()
  rows = {r['path']: r for r in sharding.param_table(s.logical_state.params, s.mesh, s.rules)}
  flat = jax.tree_util.tree_flatten_with_path(state.params)[0]
  for key_path, value in flat:
    row = rows['/'.join(k.key for k in key_path)]
    assert value.sharding.spec == jax.sharding.PartitionSpec(*row['partition_spec'])
    assert {shard.data.shape for shard in value.addressable_shards} == {tuple(row['shard_shape'])}
  # Adam's moments are sharded like the parameters they follow.
  mu = state.opt_state[1][0].mu if isinstance(state.opt_state, tuple) else None
  assert mu is not None
  for p, m in zip(jax.tree.leaves(state.params), jax.tree.leaves(mu)):
    assert m.sharding == p.sharding


# The model code's forward constraints plus their transposes in the backward pass (the
# input's constraint has none where no parameter precedes it), as lowered by JAX 0.10.2:
# mlp: input, 2 hidden, logits (4 + 3); cnn: input, 2 convs, hidden, logits (5 + 4);
# resnet smoke: input, stem, 2 blocks x (inner, out), logits (7 + 6); vit smoke: patches,
# 1 block x (q, k, v, attn, mlp, block), logits (8 + 8); transformer_lm smoke: embed,
# 2 blocks x 6, logits (14 + 14), or (8 + 8) with the blocks under nn.scan, traced once;
# encoder_decoder smoke: 2 embeds, encoder block (6), decoder block (self 4, cross 4, mlp,
# block), logits (19 + 19). Update only after adding or removing a constraint on purpose.
@pytest.mark.parametrize('model_name,expected', [('mlp', 7), ('cnn', 9), ('resnet', 13),
                                                 ('vit', 16), ('transformer_lm', 28),
                                                 ('transformer_lm_scan', 16),
                                                 ('encoder_decoder', 38)])
def test_train_step_keeps_activation_constraints(model_name, expected, devices):
  """Constraints silently vanish when traced without mesh + rules: count them."""
  s, batch = _setup(model_name)
  with s.scope():
    state = s.abstract_state()  # Abstract: lowered only.
    global_batch = feed.to_global(batch, s.batch_sharding, s.config.train.batch_size)
    text = s.jit_train_step().lower(state, global_batch).as_text()
  constraints = re.findall(r'sharding_constraint', text)
  # Forward constraints, plus their transposes in the backward pass.
  assert len(constraints) == expected, f'{len(constraints)} sharding constraints, expected {expected}'
  with jax.set_mesh(s.mesh):  # Without the rules, every logical constraint is dropped.
    # A fresh function: jit would otherwise reuse the trace made under the rules.
    bare = jax.jit(lambda st, b: steps.train_step(st, b, 1, s.task)).lower(
        state, global_batch).as_text()
  assert 'sharding_constraint' not in bare


def test_standard_rules_name_only_mesh_axes():
  names = {name for name, _ in sharding.standard_rules()}
  assert names == set(sharding.LOGICAL_AXES)
  assert not names & set(sharding.MESH_AXES), 'logical names must differ from mesh axis names'
  assert {axis for _, axis in sharding.standard_rules()} <= {None, *sharding.MESH_AXES}
