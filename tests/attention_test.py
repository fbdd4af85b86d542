"""model.attention='auto' (the default): the fused kernel of the platform a step is compiled
for (cuDNN on NVIDIA GPUs, splash on TPUs, XLA's elsewhere), XLA's in each layer that kernel
cannot take, said once per layer, and named per layer in the plan."""
import importlib.util
import json
import logging

import jax
import numpy as np
import pytest

from conftest import load_config
from zoo.data import tokenizer as tokenizer_lib
from zoo.data import tokens
from zoo.models import attention, transformer
from zoo.parallel import mesh as mesh_lib
from zoo.parallel import sharding, topology
from zoo.run import plan
from zoo.run import setup as setup_lib

needs_libtpu = pytest.mark.skipif(not importlib.util.find_spec('libtpu'), reason='needs libtpu')
needs_cuda = pytest.mark.skipif(not importlib.util.find_spec('jax_cuda12_plugin'),
                                reason="needs JAX's CUDA plugin ('.[cuda12]')")
# A rotary LM whose lengths the splash kernel takes (multiples of 128).
LM = {'model.d_model': 64, 'model.num_heads': 4, 'model.mlp_dim': 128, 'model.max_len': 128,
      'data.seq_len': 128, 'train.batch_size': 8, 'eval.batch_size': 8,
      'model.positions': 'rotary'}


@pytest.fixture(scope='module')
def packed_dir(tmp_path_factory):
  """A byte-level token dataset of documents of various lengths: packed windows of 128."""
  root = tmp_path_factory.mktemp('packed')
  rng = np.random.default_rng(0)
  with open(root / 'docs.jsonl', 'w', encoding='utf-8') as f:
    for n in [50, 300, 90, 200, 40, 500, 120, 70] * 4:
      f.write(json.dumps({'text': ''.join(rng.choice(list('abcdefghij .'), n))}) + '\n')
  (root / 'data').mkdir()
  tokens.prepare([str(root / 'docs.jsonl')], str(root / 'data'), tokenizer_lib.bytes_tokenizer(),
                 val_fraction=0.2)
  return str(root / 'data')


def _chosen(devices, mesh_shape, **overrides):
  """{layer path: (implementation, why)} of char_lm's train and eval steps traced for
  `devices` (compile-only devices of a target: lowered, not compiled)."""
  config = load_config('char_lm', **{**LM, 'mesh.shape': mesh_shape, **overrides})
  s = setup_lib.checked(config, devices, plan=True)
  with s.scope(), attention.recording() as chosen:
    s.jit_train_step().lower(s.abstract_state(), s.batch)
  return chosen


def test_auto_is_the_platforms_own_kernel():
  assert [attention.auto(p) for p in ('gpu', 'cuda', 'tpu', 'cpu', 'rocm')] == [
      'cudnn', 'cudnn', 'splash', 'xla', 'xla']
  assert transformer.Transformer.attention == 'auto'
  assert load_config('char_lm').model.attention == 'auto'


def test_auto_on_cpu_is_xla_silently_with_the_same_numbers(devices, caplog):
  """On CPU 'auto' runs XLA's attention: bit-identical to 'xla', recorded, nothing logged."""
  del devices
  mesh = mesh_lib.make_mesh((4, 2), ('batch', 'model'))
  x = jax.random.normal(jax.random.key(0), (8, 16, 32))
  make = lambda impl: transformer.Attention(num_heads=4, num_kv_heads=2, head_dim=8, causal=True,
                                            implementation=impl)
  with caplog.at_level(logging.WARNING), sharding.scope(mesh, sharding.standard_rules()):
    params = make('xla').init(jax.random.key(1), x)
    want = make('xla').apply(params, x)
    with attention.recording() as chosen:
      got = make('auto').apply(params, x)
  np.testing.assert_array_equal(got, want)
  assert chosen == {'': ('xla', '')}
  assert not [r for r in caplog.records if 'model.attention' in r.getMessage()]


def test_the_plan_names_each_layers_implementation(devices):
  del devices
  config = load_config('char_lm', **{'mesh.shape': (4, 2)})
  text = plan.format_plan(plan.make_plan(config))
  assert "attention (model.attention='auto' on cpu), per layer:\n  xla     block_0/attn, " \
         'block_1/attn\n' in text, text


@needs_libtpu
def test_auto_on_a_tpu_pod_is_splash_but_in_sliding_window_layers(caplog):
  """v5p-8 (compile-only): splash in the global layers; the local layers of a Gemma-2-like
  alternation run XLA's, each saying so once; under nn.scan the one traced block (whose
  local flag is traced) runs XLA's."""
  attention._SAID.clear()  # pylint: disable=protected-access
  devices = topology.devices(topology.parse('v5p-8'))
  with caplog.at_level(logging.WARNING):
    assert _chosen(devices, (4, 1)) == {'block_0/attn': ('splash', ''),
                                        'block_1/attn': ('splash', '')}
    windowed = {'model.sliding_window': 32, 'model.global_every': 2}
    assert _chosen(devices, (4, 1), **windowed) == {'block_0/attn': ('xla', 'a sliding window'),
                                                    'block_1/attn': ('splash', '')}
    _chosen(devices, (4, 1), **windowed)  # Traced again: nothing more is said.
    assert _chosen(devices, (4, 1), **windowed, **{'model.scan_layers': True}) == {
        'blocks/attn': ('xla', 'a sliding window')}
  said = [r.getMessage() for r in caplog.records if 'model.attention' in r.getMessage()]
  assert said == ["model.attention='auto' (splash on tpu): block_0/attn: a sliding window; "
                  "XLA's attention runs there instead",
                  "model.attention='auto' (splash on tpu): blocks/attn: a sliding window; "
                  "XLA's attention runs there instead"], said


@needs_cuda
def test_auto_on_a_gpu_is_cudnn_for_bf16_and_packed_documents(packed_dir, caplog):
  """h100-1 (compile-only): a bfloat16 model on packed documents lowers to cuDNN's fused
  attention with the segment mask as its bias; a float32 one runs XLA's and says why."""
  attention._SAID.clear()  # pylint: disable=protected-access
  devices = topology.devices(topology.parse('h100-1'))
  packed = {'data.name': 'tokens', 'data.path': packed_dir}
  assert _chosen(devices, (1, 1), **packed, **{'model.dtype': 'bfloat16'}) == {
      'block_0/attn': ('cudnn', ''), 'block_1/attn': ('cudnn', '')}
  config = load_config('char_lm', **{**LM, **packed, 'mesh.shape': (1, 1),
                                     'model.dtype': 'bfloat16'})
  s = setup_lib.checked(config, devices, plan=True)
  with s.scope():
    text = s.jit_train_step().lower(s.abstract_state(), s.batch).as_text()
  assert '__cudnn$fmhaScaleBiasSoftmax' in text and '__cudnn$fmhaScaleBiasSoftmaxBackward' in text
  with caplog.at_level(logging.WARNING):
    assert _chosen(devices, (1, 1), **packed) == {
        f'block_{i}/attn': ('xla', 'float32 computation (cuDNN takes bfloat16 or float16)')
        for i in range(2)}
  said = [r.getMessage() for r in caplog.records if 'model.attention' in r.getMessage()]
  assert len(said) == 2 and said[0].startswith("model.attention='auto' (cudnn on gpu): "
                                                'block_0/attn: float32 computation'), said
  # Rules that split queries and keys/values differently: cuDNN's partitioner would refuse
  # them when the step compiles, so 'auto' runs XLA's there and compiles.
  rules = (('act_kv_heads', None),) + tuple(sharding.standard_rules())
  split = {**packed, 'model.dtype': 'bfloat16', 'model.num_kv_heads': 2,
           'logical_axis_rules': rules}
  assert _chosen(topology.devices(topology.parse('h100-2')), (1, 2), **split) == {
      f'block_{i}/attn': ('xla', 'the rules split queries and keys/values differently')
      for i in range(2)}
