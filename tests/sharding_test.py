"""Golden sharding tables, shard shapes, activation constraints and batch rows."""
import json
import os
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from conftest import load_config
from zoo import data, models, optim, sharding, train

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
}


def _setup(model_name, mesh_shape=(4, 2)):
  experiment, overrides = MODELS[model_name]
  config = load_config(experiment, **{'mesh.shape': mesh_shape, **overrides})
  dataset = data.load(config.data, config.seed)
  mesh = sharding.make_mesh(config.mesh.shape, config.mesh.axes)
  rules = [tuple(r) for r in config.logical_axis_rules]
  model = models.build(config.model, **dataset.model_fields)
  tx, _ = optim.make_optimizer(config.train.steps, **config.optimizer)
  batch = dataset.train_batch(0, config.train.batch_size, slice(None))
  return config, mesh, rules, model, tx, batch


def _first_row(batch):
  return jax.tree.map(lambda x: jnp.asarray(x[:1]), batch)


@pytest.mark.parametrize('model_name', sorted(MODELS))
def test_golden_param_table(model_name, devices):
  del devices
  _, mesh, rules, model, tx, batch = _setup(model_name)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    _, boxed = train.abstract_state(model, tx, _first_row(batch), jax.random.key(0))
  rows = sharding.param_table(boxed.params, mesh, rules)
  rows += sharding.param_table(boxed.model_state, mesh, rules)  # BatchNorm statistics.
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
  _, mesh, rules, model, tx, batch = _setup(model_name)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    init, boxed = train.abstract_state(model, tx, _first_row(batch), jax.random.key(0))
    shardings = sharding.logical_shardings(boxed, mesh, rules)
    state = train.create_train_state(init, jax.random.key(0), shardings)
  rows = {r['path']: r for r in sharding.param_table(boxed.params, mesh, rules)}
  flat = jax.tree_util.tree_flatten_with_path(state.params)[0]
  for key_path, value in flat:
    row = rows['/'.join(k.key for k in key_path)]
    assert value.sharding.spec == jax.sharding.PartitionSpec(*row['partition_spec'])
    assert {s.data.shape for s in value.addressable_shards} == {tuple(row['shard_shape'])}
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
  config, mesh, rules, model, tx, batch = _setup(model_name)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    init, boxed = train.abstract_state(model, tx, _first_row(batch), jax.random.key(0))
    state_shardings = sharding.logical_shardings(boxed, mesh, rules)
    state, _ = train.restore_target(init, state_shardings, jax.random.key(0))  # Abstract: lowered only.
    batch_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('batch'))
    global_batch = data.to_global(batch, batch_sharding, config.train.batch_size)
    p_train, _ = train.jit_steps(state_shardings, batch_sharding, jax.random.key(1))
    text = p_train.lower(state, global_batch).as_text()
  constraints = re.findall(r'sharding_constraint', text)
  # Forward constraints, plus their transposes in the backward pass.
  assert len(constraints) == expected, f'{len(constraints)} sharding constraints, expected {expected}'
  with jax.set_mesh(mesh):  # Without the rules, every logical constraint is dropped.
    # A fresh function: jit would otherwise reuse the trace made under the rules.
    bare = jax.jit(lambda s, b: train.train_step(s, b, jax.random.key(1))).lower(
        state, global_batch).as_text()
  assert 'sharding_constraint' not in bare


def test_standard_rules_name_only_mesh_axes():
  names = {name for name, _ in sharding.standard_rules()}
  assert names == set(sharding.LOGICAL_AXES)
  assert not names & set(sharding.MESH_AXES), 'logical names must differ from mesh axis names'
  assert {axis for _, axis in sharding.standard_rules()} <= {None, *sharding.MESH_AXES}
