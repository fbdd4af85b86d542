r"""Pod plans compiled here by the TPU compiler: what fits where, at what peak, how fast.

    pip install -e '.[tpu]'
    python benchmarks/pod_plans.py                 # everything (about 1.5 hours on 2 cores)
    python benchmarks/pod_plans.py --only=plans --resume   # only the rows not in the JSON yet
    python benchmarks/pod_plans.py --only=plans    # or maxtext, cpu
    python benchmarks/pod_plans.py --only=long     # context parallelism against MaxText

Three tables (and pod_plans.json):
- plans: char_lm:100m, char_lm:1b and a Llama-3-8B-shaped decoder (abstract parameters, no
  weights) on v5litepod-256, v5p-64, v5p-256, v6e-256 and 2 slices of v5litepod-256; data
  parallel (DP), FSDP, and tensor x data parallel (TP x DP, 4-way 'model'); at 8,192
  tokens, one sequence per chip, as the experiment sets it (dots_no_batch remat, XLA
  attention) and with full remat + splash attention. Each row: the compiler's verdict, its
  peak per chip, the sum of the compiled sizes (what a sum-based check would have said),
  compile seconds, the collectives' bytes per chip.
- cpu: the same configs on v5p-64's mesh planned by `--dry_run --cpu_devices=32` (the CPU
  compiler's layout and zoo's peak sum): what a plan without libtpu would have said.
- maxtext: the Llama-2-7B shapes of issue #23 (FSDP over every chip, full remat, scanned
  layers) on v5p-64 and v5litepod-256 at 2,048 tokens and v5p-64 at 8,192: the largest
  batch per chip the compiler accepts (plan.max_batch), splash against XLA attention, and
  the train step's compile time at one sequence per chip.
- vocab: the same Llama-2-7B shapes with splash at vocabularies of 32,000 and 128,256, the
  loss computed in chunks of the sequence (model.loss_chunks, auto): the largest batch per
  chip on v5p-64 at 8,192 tokens and v5litepod-256 at 2,048 (`--only=vocab`).
- moe: Qwen3-30B-A3B shapes (routed experts) on v5p-64 at 2,048 tokens: the largest batch
  per chip with FSDP and with an expert axis, against MaxText's (`--only=moe`).
- grpo: GRPO (experiments/grpo_sort.py's settings, rank-8 LoRA, beta 0.04: no reference
  copy) on Llama-3-8B shapes (abstract parameters, FSDP, full remat, scanned layers,
  splash, bf16) with 1,024 prompt + 1,024 completion tokens and 8 completions per prompt
  on v5p-64: the largest number of prompts per step whose update and rollout (its
  key/value cache, the optimizer state resident beside it) the compiler fits
  (`--only=grpo`).
- long: issue #42's long-context rows, Llama-3-8B shapes (FSDP over batch x context, full
  remat, scanned layers, splash, bf16 compute, the chunked loss) against MaxText 0.2.5's
  train_compile (context parallelism 'all_gather', load-balanced): CP1 v5p-128 at 131,072
  tokens over context 4, CP2 v6e-256 at 32,768 over context 4 (the peak at MaxText's
  smallest batch, and the largest batch), CP3 v5p-64 at 131,072 without a context axis;
  and the train step's compile time on CP1's pod with and without the context axis
  (`--only=long`).
- quant: issue 57's, Llama-3-8B shapes at 8,192 tokens with model.quantization: int8 on
  v6e-256 and v5p-128, fp8 on TPU7x, beside bf16 there: the largest batch per device, its
  peak and the compiled step's matmuls by operand types (`--only=quant`).
"""
import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

LLAMA3_8B = dict(num_layers=32, d_model=4096, num_heads=32, num_kv_heads=8, mlp_dim=14336,
                 vocab_size=128256, positions='rotary', rope_theta=500000.0, norm='rms',
                 norm_epsilon=1e-5, mlp_activation='swiglu')
LLAMA2_7B = dict(num_layers=32, d_model=4096, num_heads=32, mlp_dim=11008, vocab_size=32000,
                 positions='rotary', norm='rms', norm_epsilon=1e-5, mlp_activation='swiglu',
                 remat='full', scan_layers=True)
# Issue #36's target, as MaxText 0.2.4's train_compile measured it with this libtpu: 48
# layers, 32 query / 4 key-value heads of 128, q/k norms, 128 experts (top 8) of 768 units,
# a 151,936-token vocabulary; full remat, scanned layers, splash, bf16 compute.
QWEN3_30B_A3B = dict(num_layers=48, d_model=2048, num_heads=32, num_kv_heads=4, head_dim=128,
                     qk_norm=True, mlp_dim=6144, num_experts=128, experts_per_token=8,
                     expert_mlp_dim=768, norm_topk_prob=True, vocab_size=151936,
                     positions='rotary', rope_theta=1e6, norm='rms', mlp_activation='swiglu',
                     remat='full', scan_layers=True, attention='splash', dtype='bfloat16')
MODELS = {'100m': ('100m', {}), '1b': ('1b', {}), 'llama3-8b': ('1b', LLAMA3_8B)}
TARGETS = [('v5litepod-256', 1), ('v5p-64', 1), ('v5p-256', 1), ('v6e-256', 1),
           ('v5litepod-256', 2)]
MESHES = {'DP': ((-1, 1), False), 'FSDP': ((-1, 1), True), 'TP x DP': ((-1, 4), False)}
# 'as set': the experiment with XLA's attention, the rows' baseline since before 'auto' (which
# picks splash on TPU, as the second variant does).
VARIANTS = {'as set': {'attention': 'xla'},
            'remat full + splash': {'remat': 'full', 'attention': 'splash'}}
SEQ = 8192


def config_for(model, mesh, variant, devices, slices=1, seq=SEQ, per_device=1):
  from zoo.parallel import sharding  # pylint: disable=import-outside-toplevel
  from zoo.run.config import load_experiment  # pylint: disable=import-outside-toplevel
  arg, fields = MODELS[model]
  shape, fsdp = MESHES[mesh]
  c = load_experiment(os.path.join(REPO, 'experiments', 'char_lm.py'), arg)
  c.model.update({**fields, **VARIANTS[variant], 'max_len': seq})
  c.data.seq_len = seq
  c.mesh.shape, c.mesh.dcn_shape = shape, (slices, 1)
  c.logical_axis_rules = sharding.fsdp_rules() if fsdp else sharding.standard_rules()
  c.train.batch_size = per_device * devices
  c.eval.batch_size = devices
  return c


def _collectives(rows):
  return ', '.join(f'{r["kind"]} {r["bytes"] / 2**30:.2f}G' for r in rows
                   if r['bytes'] >= 2**26) or '-'


def plans(out):
  from zoo.run import plan  # pylint: disable=import-outside-toplevel
  from zoo.parallel import topology
  done = {(r['target'], r['model'], r['mesh'], r['variant']) for r in out.get('plans', [])}
  for name, slices in TARGETS:
    target = topology.parse(name, slices)
    for model in MODELS:
      for mesh in MESHES:
        for variant in VARIANTS:
          row = {'target': f'{slices} x {name}' if slices > 1 else name, 'model': model,
                 'mesh': mesh, 'variant': variant}
          if tuple(row.values()) in done:  # --resume: measured already.
            continue
          config = config_for(model, mesh, variant, target.chips * slices, slices)
          t0 = time.perf_counter()
          try:
            p = plan.make_plan(config, target=target)
          except Exception as e:  # pylint: disable=broad-except  # Reported as a row.
            row['fits'] = f'error: {str(e).splitlines()[0][:120]}'
            print(json.dumps(row), flush=True)
            _save_row(out, 'plans', row)
            continue
          m = p['compiled_memory'] or {}
          row.update({'fits': 'yes' if p['fits'] else 'NO',
                 'peak_gib': round((p['compiled_memory'] or {}).get('peak', 0) / 2**30, 2) or (
                     round(p['refusal']['needed'] / 2**30, 2) if p['refusal'] and
                     p['refusal']['needed'] else None),
                 'sum_gib': round((m['arguments'] + m['outputs'] - m['aliased']
                                   + m['temporaries'] + m['code']) / 2**30, 2) if m else None,
                 'usable_gib': round(p['usable_bytes'] / 2**30, 2),
                 'compile_s': round(p['compile_s'], 1),
                 'plan_s': round(time.perf_counter() - t0, 1),
                 'collectives': _collectives(p['collectives'])})
          _save_row(out, 'plans', row)


def _save_row(out, section, row):
  """Prints the row and rewrites the JSON: an interrupted run keeps what it measured."""
  print(json.dumps(row), flush=True)
  out.setdefault(section, []).append(row)
  with open(out['_path'], 'w', encoding='utf-8') as f:
    json.dump({k: v for k, v in out.items() if k != '_path'}, f, indent=2)


def cpu(out):
  """Runs itself with 32 emulated CPU devices: v5p-64's chip count."""
  result = subprocess.run([sys.executable, __file__, '--only=_cpu_rows'], cwd=REPO, check=True,
                          capture_output=True, text=True,
                          env={**os.environ, 'JAX_PLATFORMS': 'cpu',
                               'XLA_FLAGS': '--xla_force_host_platform_device_count=32'})
  out['cpu'] = json.loads(result.stdout.strip().splitlines()[-1])


def _cpu_rows(out):
  from zoo.run import plan  # pylint: disable=import-outside-toplevel
  rows = []
  for model in MODELS:
    for mesh in MESHES:
      for variant in VARIANTS:
        t0 = time.perf_counter()
        p = plan.make_plan(config_for(model, mesh, variant, 32))
        rows.append({'model': model, 'mesh': mesh, 'variant': variant,
                     'cpu_peak_gib': round(p['compiled_memory']['peak'] / 2**30, 2),
                     'cpu_plan_s': round(time.perf_counter() - t0, 1)})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
  del out
  print(json.dumps(rows))


def maxtext(out):
  from zoo.run import plan  # pylint: disable=import-outside-toplevel
  from zoo.parallel import topology
  from zoo.run.config import load_experiment  # pylint: disable=import-outside-toplevel
  maxtext_batch = {('v5p-64', 2048): 97, ('v5litepod-256', 2048): 18, ('v5p-64', 8192): 22}
  for (name, seq), theirs in maxtext_batch.items():
    target = topology.parse(name)
    for attention in ('splash', 'xla'):
      c = load_experiment(os.path.join(REPO, 'experiments', 'char_lm.py'), '1b,fsdp')
      c.model.update({**LLAMA2_7B, 'attention': attention, 'max_len': seq})
      c.data.seq_len, c.eval.batch_size = seq, target.chips
      c.train.batch_size = target.chips * (theirs if attention == 'splash' else 1)
      found = plan.max_batch(c, target=target)
      row = {'target': name, 'seq': seq, 'attention': attention,
             'zoo_batch_per_chip': found['batch_per_device'], 'maxtext_splash': theirs,
             'peak_gib': round((found['peak'] or 0) / 2**30, 2), 'compiles': found['compiles'],
             'search_s': round(found['seconds']), 'other_refusals': found['other_refusals']}
      print(json.dumps(row), flush=True)
      out.setdefault('maxtext', []).append(row)
  c = load_experiment(os.path.join(REPO, 'experiments', 'char_lm.py'), '1b,fsdp')
  c.model.update({**LLAMA2_7B, 'attention': 'splash', 'max_len': 2048})
  c.data.seq_len, c.train.batch_size, c.eval.batch_size = 2048, 32, 32
  p = plan.make_plan(c, target=topology.parse('v5p-64'))
  out['compile_batch_1_v5p_64_s'] = round(p['compile_s'], 1)
  print(json.dumps({'compile at batch 1 per chip, v5p-64, splash': p['compile_s']}), flush=True)


def vocab(out):
  """Llama-2-7B shapes (as in maxtext, splash) at vocabularies of 32,000 and 128,256, the loss
  in chunks (model.loss_chunks=0, auto): the largest batch per chip. Before chunking (issue
  #35, libtpu 0.0.42.1): v5p-64 at 8,192 tokens 24 and 11 per chip, v5litepod-256 at 2,048
  tokens 18 and 7. MaxText's peer technique is num_vocab_tiling (off by default)."""
  from zoo.run import plan  # pylint: disable=import-outside-toplevel
  from zoo.parallel import topology
  from zoo.run.config import load_experiment  # pylint: disable=import-outside-toplevel
  before = {('v5p-64', 8192, 32000): 24, ('v5p-64', 8192, 128256): 11,
            ('v5litepod-256', 2048, 32000): 18, ('v5litepod-256', 2048, 128256): 7}
  for (name, seq, vocab_size), then in before.items():
    target = topology.parse(name)
    c = load_experiment(os.path.join(REPO, 'experiments', 'char_lm.py'), '1b,fsdp')
    c.model.update({**LLAMA2_7B, 'attention': 'splash', 'max_len': seq, 'vocab_size': vocab_size,
                    'loss_chunks': 0})
    c.data.seq_len, c.eval.batch_size = seq, target.chips
    c.train.batch_size = target.chips * then  # The search starts at the figure before.
    found = plan.max_batch(c, target=target)
    row = {'target': name, 'seq': seq, 'vocab': vocab_size, 'before_chunking': then,
           'zoo_batch_per_chip': found['batch_per_device'],
           'peak_gib': round((found['peak'] or 0) / 2**30, 2), 'compiles': found['compiles'],
           'search_s': round(found['seconds']), 'other_refusals': found['other_refusals']}
    print(json.dumps(row), flush=True)
    out.setdefault('vocab', []).append(row)


def moe(out):
  """Qwen3-30B-A3B shapes on v5p-64 at 2,048 tokens (moe_lm's rules: expert_rules(fsdp)):
  the largest batch per chip with FSDP over the 32 chips, and with an expert axis of 8 x
  FSDP 4, dropless (the worst-case receive buffer) and with a buffer of 2 x the rows sent
  (drops counted at run time); the train step's compile time at one sequence per chip.
  MaxText 0.2.4 (its train_compile, this libtpu): 53 with FSDP, 16 with expert parallelism
  8 x FSDP 4, its compile 48 s at batch 1."""
  from zoo.run import plan  # pylint: disable=import-outside-toplevel
  from zoo.parallel import topology
  from zoo.run.config import load_experiment  # pylint: disable=import-outside-toplevel
  target = topology.parse('v5p-64')
  # (mesh, its shape, model.expert_buffer, MaxText's batch on that mesh, the target).
  rows = [('FSDP 32', (-1, 1), 0.0, 53, 53), ('expert 8 x FSDP 4', (4, 8, 1), 2.0, 16, 53),
          ('expert 8 x FSDP 4, dropless', (4, 8, 1), 0.0, 16, 16)]
  for name, shape, buffer, maxtext_batch, target_batch in rows:
    c = load_experiment(os.path.join(REPO, 'experiments', 'moe_lm.py'),
                        'ep' if len(shape) == 3 else None)
    c.model.update({**QWEN3_30B_A3B, 'max_len': 2048, 'expert_buffer': buffer})
    c.mesh.shape = shape
    c.data.seq_len, c.eval.batch_size = 2048, target.chips
    c.train.batch_size = target.chips
    compiled = plan.make_plan(c, target=target)
    c.train.batch_size = target.chips * target_batch  # The search starts at the target.
    found = plan.max_batch(c, target=target)
    row = {'target': 'v5p-64', 'seq': 2048, 'mesh': name, 'expert_buffer': buffer,
           'zoo_batch_per_chip': found['batch_per_device'], 'maxtext_batch_per_chip': maxtext_batch,
           'target_batch_per_chip': target_batch,
           'peak_gib': round((found['peak'] or 0) / 2**30, 2), 'compiles': found['compiles'],
           'search_s': round(found['seconds']), 'other_refusals': found['other_refusals'],
           'compile_batch_1_s': round(compiled['compile_s'], 1), 'maxtext_compile_batch_1_s': 48}
    _save_row(out, 'moe', row)


def grpo_config():
  """(config, target): GRPO on Llama-3-8B shapes at 1,024 + 1,024 tokens, v5p-64."""
  import tempfile  # pylint: disable=import-outside-toplevel
  from zoo.data import writer  # pylint: disable=import-outside-toplevel
  from zoo.data import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
  from zoo.parallel import sharding, topology  # pylint: disable=import-outside-toplevel
  from zoo.run.config import load_experiment  # pylint: disable=import-outside-toplevel
  target, prompt, completion, g = topology.parse('v5p-64'), 1024, 1024, 8
  root = tempfile.mkdtemp(prefix='zoo-grpo-plan-')
  model = {'name': 'transformer_lm', **LLAMA3_8B, 'max_len': prompt + completion,
           'remat': 'full', 'scan_layers': True, 'attention': 'splash', 'dtype': 'bfloat16'}
  os.makedirs(os.path.join(root, 'model'))
  with open(os.path.join(root, 'model', 'config.json'), 'w', encoding='utf-8') as f:
    json.dump({'model': model}, f)  # What zoo.convert import writes: the model's fields.
  with open(os.path.join(root, 'prompts.jsonl'), 'w', encoding='utf-8') as f:
    for i in range(64):  # Byte prompts of 1,100 characters: 1,024 tokens kept.
      f.write(json.dumps({'prompt': ' '.join(str((i * 7 + j) % 10) for j in range(550)),
                          'answer': ''}) + '\n')
  tokenizer_lib.bytes_tokenizer().save(os.path.join(root, 'tokenizer.json'))
  writer.run('prompts', writer.Options(inputs=(os.path.join(root, 'prompts.jsonl'),),
                                       output=os.path.join(root, 'prompts'), val_fraction=0.25,
                                       tokenizer=os.path.join(root, 'tokenizer.json')))
  c = load_experiment(os.path.join(REPO, 'experiments', 'grpo_sort.py'),
                      os.path.join(root, 'model') + ',lora')
  c.data.path, c.data.seq_len = os.path.join(root, 'prompts'), prompt
  c.grpo.max_completion_tokens, c.grpo.num_generations = completion, g
  c.logical_axis_rules = sharding.fsdp_rules()
  c.train.batch_size = c.eval.batch_size = target.chips * 2
  return c, target


def grpo(out):
  """The largest GRPO step (prompts x 8 completions) on v5p-64 at 1,024 + 1,024 tokens."""
  from zoo.run import plan  # pylint: disable=import-outside-toplevel
  c, target = grpo_config()
  g = c.grpo.num_generations
  compiled = plan.make_plan(c, target=target)
  c.train.batch_size = target.chips * 32  # The search starts here.
  found = plan.max_batch(c, target=target)
  row = {'target': 'v5p-64', 'model': 'Llama-3-8B shapes, LoRA rank 8', 'tokens': '1,024 + 1,024',
         'completions_per_prompt': g,
         'fits_at_2_per_chip': compiled['fits'],
         'rollout_peak_gib_at_2_per_chip': round(compiled['totals'].get('rollout', 0) / 2**30, 2),
         'train_peak_gib_at_2_per_chip': round(compiled['totals'].get('train', 0) / 2**30, 2),
         'cache_gib_per_chip_at_2': round(compiled['rollout']['cache_per_device'] / 2**30, 2),
         'rows_per_chip': found['batch_per_device'],
         'prompts_per_step': found['global_batch'] // g,
         'peak_gib': round((found['peak'] or 0) / 2**30, 2), 'compiles': found['compiles'],
         'search_s': round(found['seconds']), 'other_refusals': found['other_refusals']}
  _save_row(out, 'grpo', row)


# Issue #42's rows, as MaxText 0.2.5's train_compile measured them (same libtpu peaks as
# this one at equal tokens per chip): (row, target, tokens, context shards, the batch whose
# peak is compared, MaxText's peak there in GiB, MaxText's largest batch, the target's).
LONG = [('CP1', 'v5p-128', 131072, 4, 16, 26.50, 48, 64),
        ('CP2', 'v6e-256', 32768, 4, 64, 7.37, 448, 448),
        # MaxText: refused at 99.77 GiB unless num_vocab_tiling=16 (65.61 GiB).
        ('CP3', 'v5p-64', 131072, 1, 32, 65.61, None, None)]  # v5p-64: 32 chips.


def long_config(seq, context, batch):
  """Llama-3-8B shapes at `seq` tokens, FSDP over batch x `context` shards (none: 1). The
  loss in the memory-lean rule's chunks (layers.loss_chunks), as when these peaks were
  measured against MaxText's: auto (zoo.run.chunks) would take fewer where they fit, faster
  and with a higher peak."""
  from zoo.models import layers  # pylint: disable=import-outside-toplevel
  from zoo.parallel import sharding  # pylint: disable=import-outside-toplevel
  from zoo.run.config import load_experiment  # pylint: disable=import-outside-toplevel
  c = load_experiment(os.path.join(REPO, 'experiments', 'char_lm.py'), '1b,fsdp')
  lean = layers.loss_chunks(0, seq, layers.padded_vocab_size(LLAMA3_8B['vocab_size']))
  c.model.update({**LLAMA3_8B, 'remat': 'full', 'scan_layers': True, 'attention': 'splash',
                  'dtype': 'bfloat16', 'max_len': seq, 'loss_chunks': lean})
  c.data.seq_len = seq
  c.logical_axis_rules = sharding.fsdp_rules()
  if context > 1:
    c.mesh.axes, c.mesh.shape = ('batch', 'context', 'model'), (-1, context, 1)
  c.train.batch_size = c.eval.batch_size = batch
  return c


# Issue 57's rows: (target, model.quantization, MaxText's bf16 batch per chip there).
QUANT = [('v6e-256', 'none', 7), ('v6e-256', 'int8', 7), ('v5p-128', 'none', 15),
         ('v5p-128', 'int8', 15), ('tpu7x:4x4x4', 'none', None), ('tpu7x:4x4x4', 'fp8', None)]


def quant(out):
  """Issue 57's plans: Llama-3-8B shapes at 8,192 tokens (long_config's: FSDP, full remat,
  scanned layers, splash, bf16 compute, the lean loss chunks) in bf16 and with low-precision
  matmuls (int8 on v6e-256 and v5p-128; fp8 on TPU7x, the generation that has it): the
  largest batch per device and its peak, and the compiled step's matmuls by operand types
  (one row a device). MaxText's bf16 batches: 7 per chip on v6e-256, 15 on v5p-128."""
  from zoo.run import plan  # pylint: disable=import-outside-toplevel
  from zoo.parallel import topology
  done = {(r['target'], r['quantization']) for r in out.get('quant', [])}  # --resume.
  for name, kind, maxtext in QUANT:
    if (name, kind) in done:
      continue
    target = topology.parse(name)
    devices = len(topology.devices(target))
    bf16 = [r['zoo_batch_per_device'] for r in out.get('quant', [])
            if r['target'] == name and r['quantization'] == 'none']
    start = maxtext or (bf16[0] if bf16 else 1)  # MaxText's, else this pod's bf16 figure.
    c = long_config(8192, 1, devices * start)
    c.model.quantization = kind
    found = plan.max_batch(c, target=target)
    c.train.batch_size = c.eval.batch_size = devices
    p = plan.make_plan(c, target=target)
    _save_row(out, 'quant', {
        'target': name, 'quantization': kind, 'maxtext_bf16_batch_per_chip': maxtext,
        'zoo_batch_per_device': found['batch_per_device'],
        'peak_gib': round((found['peak'] or 0) / 2**30, 2), 'compiles': found['compiles'],
        'search_s': round(found['seconds']), 'other_refusals': found['other_refusals'],
        'matmuls': p['matmuls'], 'quantized_kernels': len(p['quantization']['quantized'])})


def long(out):
  """Issue #42's CP1-CP3: the peak at MaxText's batch, the largest batch (CP1, CP2), the
  collectives, and the compile time against the same pod's step without a context axis."""
  from zoo.run import plan  # pylint: disable=import-outside-toplevel
  from zoo.parallel import topology  # pylint: disable=import-outside-toplevel
  done = {r['row'] for r in out.get('long', [])}  # --resume: measured already.
  for name, target_name, seq, context, batch, theirs, their_largest, goal in LONG:
    if name in done:
      continue
    target = topology.parse(target_name)
    c = long_config(seq, context, batch)
    p = plan.make_plan(c, target=target)
    row = {'row': name, 'target': target_name, 'tokens': seq, 'context': context,
           'batch': batch, 'fits': p['fits'],
           'peak_gib': round((p['compiled_memory'] or {}).get('peak', 0) / 2**30, 2),
           'maxtext_peak_gib': theirs, 'compile_s': round(p['compile_s'], 1),
           'attention': sorted({used for used, _ in p['attention']['layers'].values()}),
           'collectives': _collectives(p['collectives'])}
    if their_largest:
      found = plan.max_batch(c, target=target)
      row.update({'largest_batch': found['global_batch'], 'maxtext_largest': their_largest,
                  'target_largest': goal,
                  'largest_peak_gib': round((found['peak'] or 0) / 2**30, 2),
                  'refused_at': round(found['refused_at'] * target.chips),  # Rows, global.
                  'compiles': found['compiles'], 'search_s': round(found['seconds']),
                  'other_refusals': found['other_refusals']})
    _save_row(out, 'long', row)
  # CP1's target: every multiple of 16 up to 64 fits (the search above compiles some).
  if 'CP1 multiples of 16' not in done:
    peaks = {}
    for batch in (16, 32, 48, 64):
      p = plan.make_plan(long_config(131072, 4, batch), target=topology.parse('v5p-128'))
      peaks[batch] = round((p['compiled_memory'] or {}).get('peak', 0) / 2**30, 2)
      peaks[batch] = peaks[batch] if p['fits'] else f'refused ({peaks[batch]})'
    _save_row(out, 'long', {'row': 'CP1 multiples of 16', 'target': 'v5p-128',
                            'tokens': 131072, 'context': 4, 'peak_gib': peaks})
  # CP1's pod and tokens, one sequence per chip without a context axis (what zoo could plan
  # before issue 42), and the compile-time target: CP1's train step against that one, each
  # lowered and compiled in a fresh process with the compilation cache off.
  if 'CP1 without context' not in done:
    p = plan.make_plan(long_config(131072, 1, 64), target=topology.parse('v5p-128'))
    _save_row(out, 'long', {'row': 'CP1 without context', 'target': 'v5p-128',
                            'tokens': 131072, 'context': 1, 'batch': 64, 'fits': p['fits'],
                            'peak_gib': round((p['compiled_memory'] or {}).get('peak', 0)
                                              / 2**30, 2)})
  if 'compile' not in done:
    seconds = [_compile_seconds(131072, context, batch, 'v5p-128')
               for context, batch in ((4, 16), (1, 64))]
    _save_row(out, 'long', {'row': 'compile', 'target': 'v5p-128', 'tokens': 131072,
                            'cp1_s': seconds[0], 'without_context_s': seconds[1],
                            'ratio': round(seconds[0] / seconds[1], 2)})


def _compile_seconds(seq, context, batch, target_name):
  """Seconds to lower and compile Llama-3-8B's train step (long_config) for a target, in a
  fresh process with JAX's compilation cache off."""
  result = subprocess.run([sys.executable, __file__, '--only=_compile',
                           f'--compile={seq},{context},{batch},{target_name}'], cwd=REPO,
                          check=True, capture_output=True, text=True)
  return json.loads(result.stdout.strip().splitlines()[-1])['seconds']


def _compile_once(spec):
  import jax  # pylint: disable=import-outside-toplevel
  from zoo.parallel import topology  # pylint: disable=import-outside-toplevel
  from zoo.run import setup as setup_lib  # pylint: disable=import-outside-toplevel
  jax.config.update('jax_enable_compilation_cache', False)
  seq, context, batch, target_name = spec.split(',')
  c = long_config(int(seq), int(context), int(batch))
  s = setup_lib.checked(c, topology.devices(topology.parse(target_name)), plan=True)
  with s.scope():
    t0 = time.perf_counter()
    s.jit_train_step().lower(s.abstract_state(), s.batch).compile()
  print(json.dumps({'seconds': round(time.perf_counter() - t0, 1)}))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--only', default='plans,cpu,maxtext')
  parser.add_argument('--json', default='pod_plans.json')
  parser.add_argument('--resume', action='store_true', help='keep the rows already measured')
  parser.add_argument('--compile', default='', help=argparse.SUPPRESS)  # --only=_compile's.
  args = parser.parse_args()
  if args.only == '_cpu_rows':
    _cpu_rows({})
    return
  if args.only == '_compile':
    os.environ.setdefault('JAX_PLATFORMS', 'cpu')
    from absl import logging  # pylint: disable=import-outside-toplevel
    logging.set_verbosity(logging.ERROR)
    _compile_once(args.compile)
    return
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  from absl import logging  # pylint: disable=import-outside-toplevel
  logging.set_verbosity(logging.ERROR)  # One line per row, not the fallback warnings.
  out = {}
  if os.path.exists(args.json):
    with open(args.json, encoding='utf-8') as f:
      out = json.load(f)
  out['_path'] = args.json
  for section in args.only.split(','):
    if not args.resume:
      out.pop(section, None)
    {'plans': plans, 'cpu': cpu, 'maxtext': maxtext, 'vocab': vocab, 'moe': moe,
     'grpo': grpo, 'long': long, 'quant': quant}[section](out)
    with open(args.json, 'w', encoding='utf-8') as f:
      json.dump({k: v for k, v in out.items() if k != '_path'}, f, indent=2)
  import tables  # pylint: disable=import-outside-toplevel  # benchmarks/tables.py
  for section in ('plans', 'cpu', 'maxtext', 'vocab', 'moe', 'grpo', 'long'):
    if out.get(section):
      tables.print_rows(section, out[section])


if __name__ == '__main__':
  main()
