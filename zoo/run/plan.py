"""A run's plan without running it: `python -m zoo.main --config=... --dry_run`.

Builds the mesh and the abstract train state (no array is allocated), compiles the train
and eval steps for it and reports what each device would hold and do: the parameter
sharding table; bytes per device of parameters, optimizer state, model state and the
batch; the compiled steps' memory and whether they fit; FLOPs per step; the collectives
in the compiled train step; and which rows of the global batch each process feeds.

The devices are those present (emulated CPU devices plan a mesh larger than the machine:
the state's bytes are exact for any backend, while temporaries and collectives are the
CPU compiler's), or with `--topology` a TPU pod's compile-only devices (zoo.parallel.topology):
then the TPU compiler itself compiles the steps, its peak is the step's memory and its
out-of-memory refusal the verdict, against the chips' usable HBM.
"""
import dataclasses
import math
import re
import time
from typing import Any, Optional

import jax
import ml_collections

from zoo.errors import ConfigError
from zoo.models import attention, quantize
from zoo.parallel import hlo, sharding, topology
from zoo.run import config as cfg
from zoo.run import chunks, memory, perf, rollouts
from zoo.run.memory import size_text as _mib
from zoo.run import setup as setup_lib


def _experts_held(setup: setup_lib.Setup) -> Optional[dict]:
  """A model with routed experts: its routing, the experts each device holds, the rows it
  routes per layer, and under expert parallelism the receive buffer's rows and bytes
  (zoo.models.moe)."""
  model = setup.model
  if not getattr(model, 'num_experts', 0):
    return None
  expert_axes = sharding.mesh_axes_of(next((a for n, a in setup.rules if n == 'experts'), None))
  parallel = math.prod(setup.mesh.shape[a] for a in expert_axes)
  batch, length = setup.batch['inputs'].shape
  rows = (setup.batch_sharding.shard_shape((batch,))[0] // setup.config.train.microbatches
          * length * model.experts_per_token)
  buffer = None
  if parallel > 1 and not model.capacity_factor:
    buffer = (math.ceil(model.expert_buffer * rows) if model.expert_buffer else parallel * rows)
  width = 2 if model.dtype == 'bfloat16' else 4
  return {'layers': len(model.routed_layers()), 'experts': model.num_experts,
          'per_token': model.experts_per_token, 'expert_axes': list(expert_axes),
          'per_device': model.num_experts // parallel, 'rows': rows,
          'capacity_factor': model.capacity_factor, 'expert_buffer': model.expert_buffer,
          'buffer_rows': buffer,
          'buffer_bytes': buffer * model.d_model * width if buffer else None}


def _rollout_held(setup: setup_lib.Setup, state: Any) -> dict:
  """GRPO: the rollout's shape and its key/value cache per device (batch rows over the
  batch's shards, key/value heads over theirs where the rules split them)."""
  prompts, pad, _, _ = rollouts.abstract_inputs(setup)
  rows, length = prompts.shape
  new = setup.config.grpo.max_completion_tokens
  decoder = setup.model.clone(decode=True, cache_length=length + new)
  cache = jax.eval_shape(lambda p, x, n: decoder.apply(
      {'params': p}, x, start_B=n, mutable=['cache'])[1], state.params, prompts, pad)
  leaves = [x for path, x in jax.tree_util.tree_leaves_with_path(cache)
            if path[-1].key in ('key', 'value')]
  total = sum(x.size * x.dtype.itemsize for x in leaves)
  shards = sharding.batch_shards(setup.mesh, setup.rules)
  grouped = setup.model.kv_heads != setup.model.num_heads
  head_shards = sharding.shards(setup.mesh, setup.rules,
                                'act_kv_heads' if grouped else 'act_heads')
  heads = leaves[0].shape[-3]
  if heads % head_shards:
    head_shards = 1
  return {'rows': rows, 'prompt': length, 'completion': new, 'cache_bytes': total,
          'cache_per_device': total // (min(shards, rows) * head_shards)}


def _usable(target: Optional[topology.Target], device) -> tuple[Optional[int], str]:
  """(bytes a device may use, where the figure comes from): the target's, or where the plan
  runs on this machine's accelerators, what their runtime lets JAX use; (None, '') on CPU."""
  if target:
    return topology.usable_memory(target, device)
  local = topology.local_memory(device)
  return (local[0], f"JAX's on this {device.device_kind}: {local[1]}") if local else (None, '')


def _held(setup: setup_lib.Setup, state: Any) -> dict:
  """The state's bytes per device by part, and GRPO's reference parameters (a second copy
  of the parameters, resident throughout; none under LoRA or beta 0)."""
  held = {'params': sharding.per_device_bytes(state.params),
          'optimizer': sharding.per_device_bytes(state.opt_state),
          'model_state': sharding.per_device_bytes(state.model_state)}
  held['other'] = sharding.per_device_bytes(state) - sum(held.values())  # The step counter.
  if setup.task.name == 'grpo':
    held['reference'] = rollouts.reference_bytes(setup, state.params)
  return held


def _resident(name: str, held: dict) -> int:
  """What stays on a device beside a program's own arguments while it runs: GRPO's
  reference parameters throughout, and during the rollout (which takes the parameters
  only) the optimizer and model state."""
  beside = held['optimizer'] + held['model_state'] + held['other'] if name == 'rollout' else 0
  return held.get('reference', 0) + beside


def make_plan(config: ml_collections.ConfigDict, device_memory_gib: float = 0.0,
              target: Optional[topology.Target] = None) -> dict:
  """The plan of `config` on the present devices, or on `target`'s (see format_plan)."""
  devices = topology.devices(target) if target else jax.devices()
  cfg.validate(config, len(devices))
  setup = setup_lib.checked(config, devices, plan=True)
  usable, usable_source = _usable(target, devices[0] if target else jax.local_devices()[0])
  budget = device_memory_gib * 2**30 if device_memory_gib else None
  limit = _limit(budget, usable)
  with attention.recording() as chosen:
    # Outside the mesh's scope: another build of the setup makes its key eagerly, which
    # compile-only devices cannot.
    setup, loss = chunks.fitted(setup, limit, '--device_memory_gib' if limit and limit == budget
                                else usable_source)
    with setup.scope():
      state = setup.abstract_state()
      platform = devices[0].platform
      done = loss.compiled if loss else {}  # Compiled while choosing the loss's chunks.
      train = done.get('train') or memory.compile_step(platform, setup.jit_train_step(), state,
                                                       setup.batch)
      evaluate = done.get('eval') or memory.compile_step(platform, setup.jit_eval_step(), state,
                                                         setup.eval_batch())
      rollout = (memory.compile_step(platform, rollouts.program(setup), state.params,
                                     *rollouts.abstract_inputs(setup))
                 if setup.task.name == 'grpo' else None)
      rollout_held = _rollout_held(setup, state) if rollout is not None else None
  held = dict(_held(setup, state), batch=sharding.per_device_bytes(setup.batch))
  if setup.trainable:  # LoRA: what a full fine-tune's optimizer would hold, to compare.
    full = config.copy_and_resolve_references()
    full.model.lora.rank = 0
    held['optimizer_full_fine_tune'] = sharding.per_device_bytes(setup_lib.build(
        full, setup.dataset, mesh=setup.mesh, rules=setup.rules).abstract_state().opt_state)
  programs = {'train': train, 'eval': evaluate}
  if rollout is not None:
    programs['rollout'] = rollout
  totals = {name: c.memory['peak'] + _resident(name, held)
            for name, c in programs.items() if c.memory}
  refused = next((name for name, c in programs.items() if c.refusal), None)
  fed = setup.placement.blocks(config.train.batch_size)
  processes = len(fed['rows'])
  return judged({
      'target': target.name if target else None,
      'mesh': dict(setup.mesh.shape), 'devices': setup.mesh.size,
      'platform': platform, 'device_kind': devices[0].device_kind,
      'hosts': {'processes': processes, 'devices_per_process': setup.mesh.size // processes,
                **fed},
      'params': setup.param_table(), 'bytes_per_device': held,
      'sequence': _sequence(setup),
      'attention': {'requested': config.model.get('attention'), 'layers': chosen},
      'loss': loss and {'chunks': loss.chunks, 'tokens': loss.tokens, 'bytes': loss.logit_bytes,
                        'reason': loss.reason, 'peaks': loss.peaks},
      'experts': _experts_held(setup),
      'quantization': dict(zip(('quantized', 'kept'), setup_lib.quantized(setup)),
                           kind=config.model.get('quantization', 'none')),
      'compiled_memory': train.memory, 'eval_memory': evaluate.memory,
      'rollout': dict(rollout_held, memory=rollout.memory) if rollout is not None else None,
      'totals': totals, 'usable_bytes': usable, 'usable_source': usable_source,
      'refusal': {'step': refused, 'message': programs[refused].refusal,
                  'needed': programs[refused].needed and
                            programs[refused].needed + _resident(refused, held)}
                 if refused else None,
      'step_cost': perf.step_cost(setup, state, train.program),
      'compile_s': train.seconds, 'eval_compile_s': evaluate.seconds,
      'collectives': hlo.collectives(train.program.as_text(), setup.mesh) if train.program else [],
      'matmuls': {' x '.join(map(str, types)): n for types, n in hlo.matmul_types(
          train.program.as_text()).most_common()} if train.program else {},
  }, device_memory_gib)


def judged(p: dict, device_memory_gib: float = 0.0) -> dict:
  """The plan `p` with its verdict against `device_memory_gib` (0: none) and the devices'
  usable memory: 'device_memory_bytes', and 'fits' (False where a program was refused or a
  total passes the smaller limit; None where there is no limit)."""
  budget = device_memory_gib * 2**30 if device_memory_gib else None
  train_refused = p['refusal'] is not None and p['refusal']['step'] == 'train'
  if budget and p['compiled_memory'] is None and not train_refused:
    raise ConfigError('--device_memory_gib: this backend gives no memory analysis of the '
                      'compiled step, so the budget cannot be checked; drop the flag')
  limit = _limit(budget, p['usable_bytes'])
  fits = False if p['refusal'] else None if limit is None else all(
      total <= limit for total in p['totals'].values())
  return {**p, 'device_memory_bytes': budget, 'fits': fits}


def _limit(*sizes: Optional[float]) -> Optional[float]:
  """The smallest of the memory limits given (bytes; None or 0: not given), or None."""
  given = [x for x in sizes if x]
  return min(given) if given else None


def _hosts(p: dict) -> list[str]:
  hosts = p['hosts']
  spans = [f'{i}: {a}-{b - 1}' for i, (a, b) in hosts['rows'].items()]
  shown = lambda spans: ', '.join(spans[:8]) + (f', ... {spans[-1]}' if len(spans) > 8 else '')
  lines = [f'hosts: {hosts["processes"]} processes x {hosts["devices_per_process"]} devices; '
           f'rows of the global batch each feeds: {shown(spans)}']
  if 'positions' in hosts:  # Context parallelism: each places only its sequence slice.
    spans = [f'{i}: ' + ' '.join(f'{a}-{b - 1}' for a, b in held[:4])
             + (f' ... ({len(held)} spans)' if len(held) > 4 else '')
             for i, held in hosts['positions'].items()]
    lines.append('  of those rows\' positions (in their load-balanced order), each places only: '
                 + shown(spans))
  return lines


def _sequence(setup: setup_lib.Setup) -> Optional[dict]:
  """How the rules split a train batch's sequence (context parallelism); None: whole."""
  shards = sharding.sequence_shards(setup.mesh, setup.rules)
  if shards <= 1 or 'inputs' not in setup.batch:
    return None
  return {'length': setup.batch['inputs'].shape[-1], 'shards': shards,
          'axes': list(sharding.sequence_mesh_axes(setup.rules)),
          'balanced': setup.task.balanced}


def _sequence_lines(p: dict) -> list[str]:
  s = p.get('sequence')
  if not s:
    return []
  return [f"sequence: {s['length']:,} positions split {s['shards']} ways over {tuple(s['axes'])}, "
          f"{s['length'] // s['shards']:,} per device; keys and values gathered in attention"
          + (f", rows fed load-balanced ({2 * s['shards']} chunks, zoo.parallel.context)"
             if s['balanced'] else '')]


def _memory_lines(p: dict) -> list[str]:
  m, lines = p['compiled_memory'], []
  if m is None:
    return [] if p['refusal'] else ['  (this backend gives no memory analysis of the compiled '
                                    'step)']
  lines.append('compiled train step, per device (XLA memory analysis):')
  for key, label in (('arguments', 'arguments (state + batch)'),
                     ('outputs', 'outputs (new state + metrics)'),
                     ('aliased', 'outputs aliasing donated args'),
                     ('temporaries', 'temporaries'), ('code', 'generated code')):
    lines.append(f'  {label:32s}{_mib(m[key]):>14s}')
  if p['platform'] == 'tpu':
    lines.append(f'  peak, by the compiler: {_mib(m["peak"])} (temporaries can exceed it: '
                 'they are not all live at once)')
  else:
    lines.append(f'  peak = args + outputs - aliased + temporaries + code: {_mib(m["peak"])}')
  lines.append('  (not counted: prefetched batches, the runtime\'s own reserve)')
  if p['eval_memory']:
    lines.append(f'compiled eval step, per device: peak {_mib(p["eval_memory"]["peak"])}')
  return lines + _rollout_lines(p)


def _rollout_lines(p: dict) -> list[str]:
  """GRPO: the rollout's compiled peak and what stays resident beside each program."""
  held = p.get('rollout')
  if not held:
    return []
  lines = [f'rollout (GRPO): {held["rows"]:,} rows of {held["prompt"]:,} prompt + '
           f'{held["completion"]:,} completion tokens; key/value cache '
           f'{_mib(held["cache_per_device"])} per device']
  if held['memory']:
    lines.append(f'  compiled rollout, per device: peak {_mib(held["memory"]["peak"])} '
                 '(parameters, cache, sampling)')
  reference = p['bytes_per_device'].get('reference', 0)
  lines.append(f'  reference parameters: {_mib(reference)} per device, resident throughout'
               if reference else '  reference parameters: none (beta 0, or LoRA: the base '
               'with adapters off)')
  for name, total in p['totals'].items():
    beside = ['reference'] * bool(reference) + ['optimizer state'] * (name == 'rollout')
    if beside:
      lines.append(f'  {name} peak + {" + ".join(beside)}: {_mib(total)}')
  return lines


def _loss_lines(p: dict) -> list[str]:
  held = p.get('loss')
  if not held:
    return []
  return [chunks.Choice(held['chunks'], held['tokens'], held['bytes'], held['reason']).line()]


def _quantization_lines(p: dict) -> list[str]:
  """What runs quantized, and the compiled train step's matmuls by operand types (what the
  compiler kept of it)."""
  q = p['quantization']
  line = quantize.summary(q['kind'], q['quantized'], q['kept'])
  if not line:
    return []
  return [line, '  matmuls in the compiled train step, by operand types: ' + ', '.join(
      f'{n} {types}' for types, n in p['matmuls'].items())]


def _experts_lines(p: dict) -> list[str]:
  held = p.get('experts')
  if not held:
    return []
  where = (f'{held["per_device"]} per device over mesh axes {tuple(held["expert_axes"])}'
           if held['expert_axes'] else 'all on every device')
  lines = [f'routed experts: {held["layers"]} layers of {held["experts"]} experts, '
           f'{held["per_token"]} per token ({where}); {held["rows"]:,} rows routed per device '
           f'and layer']
  if held['capacity_factor']:
    lines.append(f'  capacity factor {held["capacity_factor"]}: rows past an expert\'s '
                 'capacity are dropped, counted in train/moe/dropped')
  elif held['buffer_rows']:
    size = (f'{held["expert_buffer"]} x the rows sent' if held['expert_buffer'] else
            'the worst case, dropless')
    lines.append(f'  receive buffer {held["buffer_rows"]:,} rows ({size}): '
                 f'{_mib(held["buffer_bytes"])} per device'
                 + ('; rows past it are dropped, counted in train/moe/dropped'
                    if held['expert_buffer'] else ''))
  else:
    lines.append('  dropless: every row reaches its expert')
  return lines


def _attention_lines(p: dict) -> list[str]:
  """Which implementation each attention layer runs (layers under nn.scan are one path)."""
  chosen = p['attention']['layers']
  if not chosen:
    return []
  lines = [f"attention (model.attention={p['attention']['requested']!r} on "
           f"{p['platform']}), per layer:"]
  groups = {}
  by_number = lambda item: [int(t) if t.isdigit() else t for t in re.split(r'(\d+)', item[0])]
  for path, (used, why) in sorted(chosen.items(), key=by_number):  # block_2 before block_10.
    groups.setdefault((used, why), []).append(path)
  for (used, why), paths in groups.items():
    shown = ', '.join(paths[:3]) + (f' ... ({len(paths)} in all)' if len(paths) > 3 else '')
    lines.append(f'  {used:8s}{shown}' + (f' (not its kernel: {why})' if why else ''))
  return lines


def verdict(p: dict) -> str:
  """'fits in ...', 'DOES NOT FIT in ...', or '' where nothing was checked."""
  limit = _limit(p['device_memory_bytes'], p['usable_bytes'])
  where = (f'{_mib(limit)} per device' + (f' ({p["usable_source"]})'
                                          if limit == p['usable_bytes'] else '')) if limit else ''
  if p['refusal']:
    needed = p['refusal']['needed']
    return (f'DOES NOT FIT: the compiler refused the {p["refusal"]["step"]} step'
            + (f', which needs {_mib(needed)} per device' if needed else '')
            + (f' of {where}' if where and needed else '') + f': {p["refusal"]["message"]}')
  if p['fits'] is None:
    return ''
  return f'{"fits" if p["fits"] else "DOES NOT FIT"} in {where}'


def format_plan(p: dict) -> str:
  """The plan as text."""
  on = f' ({p["device_kind"]}, {p["target"]})' if p['target'] else ''
  compiled = (f'the train step compiled in {p["compile_s"]:.1f} s, the eval step in '
              f'{p["eval_compile_s"]:.1f} s')
  lines = [f'mesh {p["mesh"]} on {p["devices"]} {p["platform"]} devices{on}; {compiled}', '',
           sharding.format_param_table(p['params']), '', *_hosts(p), *_sequence_lines(p),
           *_attention_lines(p), *_loss_lines(p), *_quantization_lines(p), *_experts_lines(p),
           'per device:']
  held = p['bytes_per_device']
  for key, label in (('params', 'parameters'), ('optimizer', 'optimizer state'),
                     ('optimizer_full_fine_tune', '  (a full fine-tune\'s)'),
                     ('model_state', 'model state (BatchNorm)'), ('batch', 'train batch'),
                     ('other', 'step counter')):
    if held.get(key):
      lines.append(f'  {label:32s}{_mib(held[key]):>14s}')
  lines += _memory_lines(p)
  if verdict(p):
    lines.append(verdict(p))
  lines.append(perf.format_cost(p['step_cost']))
  lines.append('collectives in the compiled step (an op in a loop body is listed once):')
  if not p['collectives']:
    lines.append('  none')
  for r in p['collectives']:
    group = f'groups of {r["group_size"]} ({r["axes"]})' if r['group_size'] else (
        'across slices' if r['axes'] == 'slices' else 'point to point')
    lines.append(f'  {r["kind"]:20s}{r["count"]:4d} x, {group:28s}'
                 f'{_mib(r["bytes"]):>14s} per device')
  return '\n'.join(lines)


def refusal_line(p: dict, device_memory_gib: float = 0.0) -> str:
  """The one line a plan that does not fit exits with: the figures and what to change."""
  change = memory.advice(p['platform'])
  refusal = p['refusal']
  if refusal and refusal['needed'] is None:
    return (f'zoo: the {p["platform"].upper()} compiler refused the {refusal["step"]} step: '
            f'{refusal["message"]}')
  limit = _limit(p['device_memory_bytes'], p['usable_bytes'])
  step = refusal['step'] if refusal else next(
      name for name, total in p['totals'].items() if total > limit)
  needed = refusal['needed'] if refusal else p['totals'][step]
  usable = p['usable_bytes']
  if usable and (not device_memory_gib or usable <= device_memory_gib * 2**30):
    where = p['target'] or f'this {p["device_kind"]}'
    limit = f'the {_mib(usable)} per device that {where} allows ({p["usable_source"]})'
  else:
    limit = f'--device_memory_gib={device_memory_gib:g}'
  return (f'zoo: the {step} step needs {needed / 2**30:.2f} GiB per device, more than {limit}; '
          f'{change}')


def _row_unit(setup: setup_lib.Setup) -> int:
  """The rows that one more example per device adds to the global batch: the device count,
  or the device count / k where the rules split the sequence over k devices."""
  return setup.mesh.size // sharding.sequence_shards(setup.mesh, setup.rules)


def _probe(setup: setup_lib.Setup, per_device: int) -> dict:
  """The train step (and GRPO's rollout) compiled for `per_device` examples per device (per
  k devices where a row spans k: _row_unit)."""
  size = per_device * _row_unit(setup)
  config = setup.config.copy_and_resolve_references()
  config.train.batch_size = size
  batch = {k: jax.ShapeDtypeStruct((size,) + v.shape[1:], v.dtype, sharding=v.sharding)
           for k, v in setup.batch.items()}
  probe = dataclasses.replace(setup, config=config, batch=batch)
  platform = probe.mesh.devices.flat[0].platform
  with probe.scope():
    state = probe.abstract_state()
    programs = {'train': memory.compile_step(platform, probe.jit_train_step(), state, batch)}
    if probe.task.name == 'grpo':
      programs['rollout'] = memory.compile_step(platform, rollouts.program(probe),
                                                state.params, *rollouts.abstract_inputs(probe))
  return programs


def max_batch(config: ml_collections.ConfigDict, device_memory_gib: float = 0.0,
              target: Optional[topology.Target] = None, largest: int = 4096) -> dict:
  """The largest train batch per device whose step the compiler fits (and, if given,
  within --device_memory_gib): doubling from the config's, then bisecting. A refusal that
  is not for HBM (the TPU compiler's scoped-VMEM errors are not monotonic in the batch) is
  recorded as what it is and stepped around, never bisected across. Where the rules split
  the sequence over k devices (context parallelism) a row spans k of them: the search
  counts rows per k devices, so a global batch smaller than the device count is tried."""
  devices = topology.devices(target) if target else jax.devices()
  cfg.validate(config, len(devices))
  setup = setup_lib.checked(config, devices, plan=True)
  usable = _usable(target, devices[0] if target else jax.local_devices()[0])[0]
  limit = _limit(device_memory_gib * 2**30, usable)
  if limit is None:
    raise ConfigError('--max_batch: this backend has no memory limit to search against; give '
                      '--device_memory_gib or a --topology')
  shards = sharding.batch_shards(setup.mesh, setup.rules)
  unit = _row_unit(setup)
  step = config.train.microbatches * shards // math.gcd(config.train.microbatches * shards, unit)
  if setup.task.name == 'grpo':  # Whole groups of num_generations completions.
    g = config.grpo.num_generations
    step = math.lcm(step, g // math.gcd(g, unit))
  held = _held(setup, setup.abstract_state())
  probes, peaks, t0 = {}, {}, time.perf_counter()

  def fits(b):  # True, False (out of memory) or None (refused for another reason).
    if b not in probes:
      probes[b] = _probe(setup, b)
      peaks[b] = max((c.memory['peak'] + _resident(name, held)
                      for name, c in probes[b].items() if c.memory), default=None)
    programs = probes[b].values()
    if any(c.refusal and c.needed is None for c in programs):
      return None
    return all(c.memory is not None for c in programs) and peaks[b] <= limit

  good, bad = 0, None
  b = max(config.train.batch_size // unit // step * step, step)
  while bad is None and b <= largest:  # Doubling while it fits.
    verdict = fits(b)
    if verdict is None:
      b += step
    elif verdict:
      good, b = b, b * 2
    else:
      bad = b
  while good == 0 and bad is not None and bad > step:  # Too big from the start: halving.
    half = max(bad // 2 // step * step, step)
    if fits(half):
      good = half
    else:
      bad = half
  lo, hi = good, bad if bad is not None else largest + step
  while hi - lo > step:  # Bisecting; another refusal at the middle: its neighbours decide.
    mid = (lo + hi) // 2 // step * step
    for probe in sorted(range(lo + step, hi, step), key=lambda x: abs(x - mid)):
      verdict = fits(probe)
      if verdict is not None:
        break
    else:
      break
    lo, hi = (probe, hi) if verdict else (lo, probe)

  def per_device(b):  # An int, or a fraction where a row spans several devices.
    return b * unit // setup.mesh.size if b * unit % setup.mesh.size == 0 else (
        b * unit / setup.mesh.size)
  return {'batch_per_device': per_device(lo), 'global_batch': lo * unit,
          'peak': peaks[lo] if lo else None, 'limit': limit, 'refused_at': per_device(hi),
          'other_refusals': {per_device(b): c.refusal for b, programs in sorted(probes.items())
                             for c in programs.values()
                             if c.refusal and c.needed is None},
          'compiles': sum(map(len, probes.values())), 'seconds': time.perf_counter() - t0}


def format_max_batch(m: dict) -> str:
  lines = [f'largest train batch that fits: {m["batch_per_device"]:g} per device '
           f'(train.batch_size={m["global_batch"]})'
           + (f', peak {_mib(m["peak"])} of {_mib(m["limit"])}' if m['peak'] else '')
           + f'; {m["compiles"]} compiles in {m["seconds"]:.0f} s']
  for b, message in sorted(m['other_refusals'].items()):
    lines.append(f'  {b:g} per device: refused for another reason than memory: {message}')
  return '\n'.join(lines)
