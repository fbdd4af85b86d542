"""Hugging Face weights in and out of a zoo workdir: what `zoo.convert import|export` runs
(see zoo/convert.py for the formats)."""
import collections
import dataclasses
import json
import math
import os
from typing import Any

from absl import logging
import jax
import ml_collections
import numpy as np

from zoo import models
from zoo.data import tokenizer as tokenizer_lib
from zoo.data.dataset import Dataset
from zoo.errors import ConfigError
from zoo.hf import adapters
from zoo.hf import layouts as hf
from zoo.models import lora
from zoo.run import config as cfg
from zoo.run import setup as setup_lib
from zoo.run import workdir as workdir_lib
from zoo.store import checkpoint, storage
from zoo.store.workdir import Workdir

WEIGHTS, INDEX = 'model.safetensors', 'model.safetensors.index.json'
TOKENIZER = Workdir.TOKENIZER


def _check_local(hf_dir: str) -> None:
  """Hugging Face directories are local: transformers and safetensors read and write files."""
  if storage.is_remote(hf_dir):
    raise ConfigError(f'--hf_dir: {hf_dir}: a Hugging Face model directory is local (transformers '
                      'and safetensors read files); copy it here first (gcloud storage cp -r), '
                      'or export here and copy it up. The zoo --workdir may be in a bucket')


def read_hf_dir(hf_dir: str) -> tuple[dict, dict[str, str]]:
  """(config.json, {tensor name: its safetensors file}); ConfigError for a missing piece."""
  _check_local(hf_dir)
  if not os.path.isdir(hf_dir):
    raise ConfigError(f'--hf_dir: {hf_dir} is not a directory; give a Hugging Face model '
                      'directory (config.json and model.safetensors)')
  config_path = os.path.join(hf_dir, 'config.json')
  if not os.path.isfile(config_path):
    raise ConfigError(f'--hf_dir: {hf_dir} has no config.json; give a Hugging Face model directory '
                      '(save_pretrained writes one)')
  try:
    with open(config_path, encoding='utf-8') as f:
      hf_config = json.load(f)
  except ValueError as e:
    raise ConfigError(f'--hf_dir: {config_path} is not valid JSON ({e})') from None
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  if os.path.isfile(os.path.join(hf_dir, INDEX)):
    with open(os.path.join(hf_dir, INDEX), encoding='utf-8') as f:
      weight_map = json.load(f)['weight_map']
    files = {name: os.path.join(hf_dir, file) for name, file in weight_map.items()}
  elif os.path.isfile(os.path.join(hf_dir, WEIGHTS)):
    with safe_open(os.path.join(hf_dir, WEIGHTS), 'np') as f:
      files = {name: os.path.join(hf_dir, WEIGHTS) for name in f.keys()}
  else:
    raise ConfigError(f'--hf_dir: {hf_dir} has no {WEIGHTS} or {INDEX}; save the model with '
                      'safe_serialization (the default of save_pretrained)')
  missing = sorted({f for f in files.values() if not os.path.isfile(f)})
  if missing:
    raise ConfigError(f'--hf_dir: the index names files that are missing: {", ".join(missing)}')
  return hf_config, files


def _shapes(files: dict[str, str]) -> dict[str, tuple]:
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  shapes = {}
  for file in sorted(set(files.values())):
    with safe_open(file, 'np') as f:
      for name in f.keys():
        shapes[name] = tuple(f.get_slice(name).get_shape())
  return shapes


def _read(file: str, name: str) -> np.ndarray:
  """One tensor, as numpy; bfloat16 ones through JAX's reader (numpy has no bfloat16)."""
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  with safe_open(file, 'np') as f:
    if f.get_slice(name).get_dtype() != 'BF16':
      return f.get_tensor(name)
  with safe_open(file, 'flax') as f:
    return np.asarray(f.get_tensor(name))


def _listed(names: list, limit: int = 8) -> str:
  more = f' and {len(names) - limit} more' if len(names) > limit else ''
  return ', '.join(names[:limit]) + more


def check_tensors(expected: list, shapes: dict[str, tuple], ignored: tuple) -> None:
  """ConfigError listing missing, extra and misshapen tensors."""
  want = {t.name: t.shape for t in expected}
  missing = sorted(want.keys() - shapes.keys())
  extra = sorted(n for n in shapes.keys() - want.keys() if not n.endswith(ignored))
  wrong = [f'{n} {list(shapes[n])} (config: {list(want[n])})'
           for n in sorted(want.keys() & shapes.keys()) if tuple(shapes[n]) != tuple(want[n])]
  problems = ([f'missing tensors: {_listed(missing)}'] if missing else []) + (
      [f'unexpected tensors: {_listed(extra)}'] if extra else []) + (
          [f'shapes that disagree with config.json: {_listed(wrong)}'] if wrong else [])
  if problems:
    raise ConfigError(f'--hf_dir: the weights do not fit config.json: {"; ".join(problems)}')


def shapes_dataset(task: str, model_fields: dict, example: dict) -> Dataset:
  """A Dataset that has only shapes: what places an imported model that has no data."""
  def batch(step, global_batch_size, rows):
    del step
    count = len(range(global_batch_size)[rows])
    return {k: np.repeat(v, count, axis=0) for k, v in example.items()}
  return Dataset(task=task, model_fields=model_fields, train_batch=batch,
                 eval_batches=lambda size, rows: iter(()), num_train=0)


def zoo_config(arch: hf.Architecture, fields: dict) -> ml_collections.ConfigDict:
  """The zoo config of an imported model: its fields; data that only names a shape."""
  config = cfg.base_config()
  config.model.name = arch.family
  accepted = {f.name for f in dataclasses.fields(models.MODELS[arch.family].module)}
  config.model.update({k: v for k, v in fields.items() if k in accepted})
  config.data.update(arch.kind.data(fields))
  config.mesh.shape = (-1, 1)
  return config


def _example(arch: hf.Architecture, fields: dict) -> tuple[dict, dict]:
  """(the data's model fields, one example batch) of a model with these fields."""
  size = arch.kind.size_field
  return {size: fields[size]}, arch.kind.example(fields)


def _flat(tree: Any) -> dict[str, Any]:
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {'/'.join(str(getattr(k, 'key', k)) for k in path): leaf for path, leaf in flat}


class _Experts:
  """A zoo parameter [E, ...] whose row e is HF tensor e: indexing reads only the experts
  the index asks for, one tensor at a time (a device's shard never needs the whole stack
  in host memory)."""

  def __init__(self, tensors: list, files: dict[str, str]):
    self.tensors, self.files = tensors, files

  def __getitem__(self, index: tuple) -> np.ndarray:
    rows, rest = index[0], tuple(index[1:])
    return np.stack([t.to_zoo(_read(self.files[t.name], t.name))[0][rest]
                     for t in self.tensors[rows]])


def _unscanned(params: dict[str, Any]) -> dict[str, Any]:
  """A scan_layers run's stacked `blocks/...` parameters as `block_<i>/...` per layer, the
  names the layouts use; each stacked array is let go once split."""
  for path in [p for p in params if p.startswith('blocks/')]:
    stacked = np.asarray(params.pop(path))
    for i in range(stacked.shape[0]):
      params[f'block_{i}/{path[len("blocks/"):]}'] = stacked[i]
  return params


def import_model(hf_dir: str, workdir: str, mesh_shape: str = '') -> setup_lib.Setup:
  """Writes `hf_dir`'s model into `workdir` (see the module docstring); returns its Setup."""
  hf_config, files = read_hf_dir(hf_dir)
  model_type, arch = hf.architecture(hf_config)
  fields = arch.from_hf(hf_config)
  expected = arch.tensors(fields)
  check_tensors(expected, _shapes(files), arch.ignored)
  tokenizer_file = os.path.join(hf_dir, TOKENIZER)
  if arch.kind.tokenizer:
    tokenizer = tokenizer_lib.load(tokenizer_file, '--hf_dir',
                                   f'save the tokenizer (tokenizer.json) into {hf_dir}')
    size = tokenizer_lib.vocab_size(tokenizer)
    if size > fields['vocab_size']:
      raise ConfigError(f'--hf_dir: {tokenizer_file} has ids up to {size - 1}, but the embedding '
                        f'has {fields["vocab_size"]} rows (vocab_size); give the tokenizer that '
                        'goes with the model')
  workdir = Workdir(workdir)
  workdir.check_writable()
  if workdir.has_checkpoints():
    raise ConfigError(f'--workdir: {workdir} already has checkpoints; import into a new workdir')
  config = zoo_config(arch, fields)
  model_fields, example = _example(arch, fields)
  setup = setup_lib.placed(config, shapes_dataset(arch.kind.task, model_fields, example),
                           mesh_shape, doing='importing')
  targets = _flat(setup.abstract_state().params)
  covered = [p for t in expected if t.expert is None for p in t.zoo]
  experts = {}  # Routed experts: zoo parameter [E, ...] -> its E tensors, one a row.
  for t in expected:
    if t.expert is not None:
      experts.setdefault(t.zoo[0], []).append(t)
  assert sorted(covered + list(experts)) == sorted(targets), (  # zoo.hf.layouts matches the model.
      set(covered + list(experts)) ^ set(targets))
  logging.info('importing %s (%s, %d tensors) onto mesh %s', hf_dir, model_type, len(expected),
               dict(setup.mesh.shape))
  params = {}
  place = lambda target, part: jax.make_array_from_callback(
      target.shape, target.sharding,
      lambda index: np.ascontiguousarray(part[index], target.dtype))
  for tensor in expected:  # One HF tensor in host memory at a time.
    if tensor.expert is not None:
      continue
    parts = tensor.to_zoo(_read(files[tensor.name], tensor.name))
    for path, part in zip(tensor.zoo, parts):
      assert tuple(part.shape) == tuple(targets[path].shape), (path, part.shape, targets[path])
      params[path] = place(targets[path], part)
    del parts
  for path, rows in experts.items():
    params[path] = place(targets[path], _Experts(sorted(rows, key=lambda t: t.expert), files))
  tree = jax.tree_util.tree_unflatten(
      jax.tree.structure(setup.abstract_state().params),
      [params[p] for p in _flat(setup.abstract_state().params)])
  workdir.make()  # Local or gs://, one way.
  workdir.write_text(Workdir.CONFIG, config.to_json_best_effort(indent=2))
  workdir.write_json('imported.json', {'hf_dir': os.path.abspath(hf_dir),
                                       'model_type': model_type, 'hf_config': hf_config})
  if arch.kind.tokenizer:
    for name in (TOKENIZER, *workdir_lib.TOKENIZER_EXTRAS):
      if os.path.isfile(os.path.join(hf_dir, name)):
        with open(os.path.join(hf_dir, name), encoding='utf-8') as f:
          workdir.write_text(name, f.read())
  # Uncompressed: zstd would hold a second copy of the model in host memory until commit.
  manager = checkpoint.make_manager(workdir.path, keep=1, use_async=False, compress=False)
  step = jax.device_put(np.zeros((), np.int32),
                        jax.sharding.NamedSharding(setup.mesh, jax.sharding.PartitionSpec()))
  manager.save(0, args=checkpoint.save_args({'step': step, 'params': tree}))
  manager.wait_until_finished()
  manager.close()
  logging.info('wrote %s: %s parameters', workdir,
               f'{sum(math.prod(x.shape) for x in params.values()):,}')
  return setup


def export_model(workdir: str, hf_dir: str, max_shard_bytes: int = 4 * 2**30,
                 peft: bool = False) -> str:
  """Writes `workdir`'s newest params into a new `hf_dir` that transformers loads; returns
  the HF model type. A LoRA run's adapters are merged into the weights they adapt, or with
  `peft` written alone as a PEFT adapter directory (zoo.hf.adapters). The host holds the
  params once, beside one shard of the output: each HF tensor is made as its shard is
  written, and each zoo parameter let go once converted."""
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  config, directory = workdir_lib.load_run(workdir, require_lm=False)
  found = hf.architecture_of(config.model.to_dict())
  if found is None:
    layouts = ', '.join(sorted(hf.ARCHITECTURES))
    raise ConfigError(f'--workdir: {workdir} trained a {config.model.get("name")!r} model that '
                      f'matches none of the layouts export writes ({layouts}: '
                      'see zoo.hf.layouts); import one of those to fine-tune it')
  model_type, arch = found
  spec = lora.of(config.model.get('lora') or {})
  if peft:
    adapters.check(model_type, spec)
  _check_local(hf_dir)
  if os.path.exists(hf_dir) and os.listdir(hf_dir):
    raise ConfigError(f'--hf_dir: {hf_dir} exists and is not empty; give a new directory')
  tokenizer_file = workdir_lib.tokenizer_file(workdir, config)
  if arch.kind.tokenizer and not tokenizer_file and not peft:
    raise ConfigError(f'--workdir: {workdir} has no tokenizer.json (nor has its data.path); '
                      'export needs the tokenizer the model was trained with')
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  shapes = checkpoint.latest_metadata(directory)['params']
  target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), shapes)
  restored, step, _ = checkpoint.restore_params(directory, target, field='--workdir')
  params = _unscanned(_flat(restored))
  del restored
  fields = {k: v for k, v in config.model.to_dict().items() if v is not None}  # None: data's.
  if arch.kind.size_field not in fields:  # Its data's size.
    fields = {**workdir_lib.run_dataset(workdir, config).model_fields, **fields}
  fields = arch.from_params(hf.with_defaults(fields), params)
  os.makedirs(hf_dir, exist_ok=True)
  if peft:  # The base: the HF directory the run (or the run it started from) imported.
    base = None
    for source in (workdir, config.checkpoint.get('init_from') or ''):
      if source and Workdir(source).has('imported.json'):
        base = Workdir(source).read_json('imported.json').get('hf_dir')
        break
    adapters.write(hf_dir, params, spec, fields['num_layers'], base, save_file)
    logging.info('exported the LoRA adapters of step %d of %s (%s, rank %d) to %s', step,
                 workdir, model_type, spec.rank, hf_dir)
    return model_type
  if spec.rank:
    adapters.merge(params, spec)
  _write_safetensors(arch.tensors(fields), params, hf_dir, max_shard_bytes, save_file)
  hf_config = {**arch.to_hf(fields), 'torch_dtype': 'float32', 'dtype': 'float32'}
  if tokenizer_file:  # Generation stops at the tokenizer's end token, not HF's default's.
    hf_config.update(_special_ids(tokenizer_lib.load(
        tokenizer_file, '--workdir', 'give the tokenizer.json the model was trained with')))
  with open(os.path.join(hf_dir, 'config.json'), 'w', encoding='utf-8') as f:
    json.dump(hf_config, f, indent=2)
  if tokenizer_file:
    with open(os.path.join(hf_dir, TOKENIZER), 'w', encoding='utf-8') as f:
      f.write(storage.read_text(tokenizer_file))
  for extra in workdir_lib.TOKENIZER_EXTRAS:  # The chat template, special tokens.
    if Workdir(workdir).has(extra):
      with open(os.path.join(hf_dir, extra), 'w', encoding='utf-8') as f:
        f.write(Workdir(workdir).read_text(extra))
  logging.info('exported step %d of %s as %s (%s) to %s', step, workdir, arch.hf_class,
               model_type, hf_dir)
  return model_type


def _special_ids(tokenizer) -> dict:
  """bos/eos token ids for a HF config: the tokenizer's own, None where it has none (GPT-2
  begins and ends with its one end token)."""
  eos = tokenizer_lib.eos_id(tokenizer)
  bos = next((i for name in ('<s>', '<|begin_of_text|>', '<bos>')
              if (i := tokenizer.token_to_id(name)) is not None), eos)
  return {'bos_token_id': bos if bos >= 0 else None, 'eos_token_id': eos if eos >= 0 else None}


def _write_safetensors(tensors: list, params: dict, hf_dir: str, max_bytes: int,
                       save_file) -> None:
  """One model.safetensors, or shards of at most `max_bytes` with HF's index, as float32.
  A shard's tensors are made from `params` just before it is written, and the zoo
  parameters they came from are dropped from `params`."""
  groups, size = [[]], 0
  for tensor in tensors:
    nbytes = math.prod(tensor.shape) * 4
    if groups[-1] and size + nbytes > max_bytes:
      groups.append([])
      size = 0
    groups[-1].append(tensor)
    size += nbytes
  files = ([WEIGHTS] if len(groups) == 1 else
           [f'model-{i + 1:05d}-of-{len(groups):05d}.safetensors' for i in range(len(groups))])
  weight_map, total = {}, 0
  uses = collections.Counter(p for t in tensors for p in t.zoo)  # An expert stack: E uses.

  def take(path, expert):  # The parameter (or its row), let go after its last use.
    uses[path] -= 1
    value = params[path] if uses[path] else params.pop(path)
    return np.asarray(value if expert is None else value[expert])
  for file, group in zip(files, groups):
    shard = {}
    for tensor in group:
      shard[tensor.name] = np.ascontiguousarray(
          tensor.to_hf(*(take(p, tensor.expert) for p in tensor.zoo)), np.float32)
      total += shard[tensor.name].nbytes
    save_file(shard, os.path.join(hf_dir, file), metadata={'format': 'pt'})
    weight_map.update({name: file for name in shard})
    del shard
  if len(groups) > 1:
    with open(os.path.join(hf_dir, INDEX), 'w', encoding='utf-8') as f:
      json.dump({'metadata': {'total_size': total}, 'weight_map': weight_map}, f, indent=2)
