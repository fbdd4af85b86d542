"""BatchNorm: statistics over the global batch on any mesh, sharded by name, checkpointed."""
import jax
import numpy as np

from conftest import trainer
from zoo.store import checkpoint


def _stats(t):
  return {jax.tree_util.keystr(k): np.asarray(v)
          for k, v in jax.tree_util.tree_flatten_with_path(t.state.model_state)[0]}


def test_statistics_are_equal_on_every_mesh(devices):
  del devices
  # No warmup: steps 2 and 3 follow real updates (smoke's warmup starts at a rate of 0).
  runs = {shape: trainer('resnet_digits', **{'mesh.shape': shape, 'optimizer.warmup_steps': 0})
          for shape in [(8, 1), (2, 4)]}
  losses = {shape: t.run(3) for shape, t in runs.items()}
  np.testing.assert_allclose(losses[(2, 4)], losses[(8, 1)], rtol=2e-5)
  a, b = _stats(runs[(8, 1)]), _stats(runs[(2, 4)])
  assert a.keys() == b.keys() and len(a) == 2 * 6  # mean and var of 6 BatchNorm layers (smoke).
  for name in a:
    np.testing.assert_allclose(b[name], a[name], rtol=1e-5, atol=1e-7, err_msg=name)
  initial = {jax.tree_util.keystr(k): np.asarray(v) for k, v in
             jax.tree_util.tree_flatten_with_path(runs[(8, 1)].initial.model_state)[0]}
  assert any(not np.allclose(a[n], initial[n]) for n in a), 'the statistics never moved'
  # Sharded like the channels they describe: a block's inner statistics split over 'model'.
  inner = runs[(2, 4)].state.model_state['batch_stats']['stage_0_block_0']['bn_0']['mean']
  assert inner.sharding.spec == jax.sharding.PartitionSpec('model')


def test_statistics_are_checkpointed_and_restore_onto_another_mesh(tmp_path, devices):
  """Saved with the state by the trainer's own functions, restored into another mesh's shards."""
  del devices
  source, dest = (trainer('resnet_digits', **{'mesh.shape': shape}) for shape in [(8, 1), (2, 4)])
  source.run(3)
  manager = checkpoint.make_manager(str(tmp_path), keep=1, use_async=False)
  manager.save(3, args=checkpoint.save_args(checkpoint.saved_tree(source.state)))
  manager.wait_until_finished()
  with dest.scope():
    target = checkpoint.saved_tree(dest.setup.abstract_state())
    restored, step = checkpoint.restore_latest(manager, target, fallback=False)
  manager.close()
  assert step == 3 and 'model_state' in restored
  stats = restored['model_state']['batch_stats']['stage_0_block_0']['bn_0']['mean']
  assert stats.sharding.spec == jax.sharding.PartitionSpec('model')  # The new mesh's layout.
  for x, y in zip(jax.tree.leaves(restored['model_state']), jax.tree.leaves(source.state.model_state)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
