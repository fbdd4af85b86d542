"""A decoder-only Transformer language model (GPT-style, pre-norm).

References: Vaswani et al., 2017 (arXiv:1706.03762); Radford et al., 2019 (GPT-2).
The layers and their switches (scan, remat, bf16, dropout, rotary) are in
zoo.models.transformer. Shapes are suffixed: B batch, L length, D d_model, V padded vocab.
"""
from typing import Optional, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from zoo.errors import fail
from zoo.models import layers, moe as moe_lib, transformer
from zoo.models.family import ModelFamily


class TransformerLM(transformer.Transformer, kw_only=True):
  """Token ids [B, L] -> next-token logits [B, L, padded vocab] in float32 (or, given the
  targets, each one's loss: what training and evaluation ask for).

  GPT-2 is learned positions, LayerNorm, 'gelu', use_bias and tie_embeddings; Llama is
  rotary positions, 'rms', 'swiglu', num_kv_heads and an untied head; Mistral, Qwen and
  Gemma add the switches of zoo.models.transformer (zoo.hf.layouts).
  """
  vocab_size: int
  max_len: int
  positions: str = 'learned'
  tie_embeddings: bool = False   # The output head is the embedding table, transposed.
  loss_chunks: int = 0           # With targets: the loss's chunks of the sequence; 0: auto.
  # Routed experts (zoo.models.moe): each MLP becomes num_experts experts of which every
  # token takes experts_per_token; 0: dense MLPs.
  num_experts: int = 0
  experts_per_token: int = 2
  expert_mlp_dim: int = 0        # Each expert's hidden units; 0: mlp_dim.
  norm_topk_prob: bool = True    # The k chosen gates renormalised to sum to 1 (Mixtral).
  shared_expert_dim: int = 0     # A gated dense expert every token takes (Qwen2-MoE); 0: none.
  dense_layers: tuple = ()       # Layers that keep a dense MLP (Qwen3-MoE's mlp_only_layers).
  capacity_factor: float = 0.0   # > 0: an expert takes at most this x its even share; 0: dropless.
  expert_buffer: float = 0.0     # Expert parallelism's receive buffer, x the rows a device
                                 # sends; 0: the worst case (dropless).
  grouped_matmul: str = 'auto'   # Megablox on TPU, Mosaic GPU's on GPUs, else ragged_dot.
  router_aux_coef: float = 0.001  # The load-balance loss's weight (Hugging Face's convention).
  router_z_coef: float = 0.0     # The router z-loss's weight (ST-MoE).

  @property
  def moe(self) -> moe_lib.Moe:
    return moe_lib.Moe(self.num_experts, self.experts_per_token,
                       self.expert_mlp_dim or self.mlp_dim, self.norm_topk_prob,
                       self.shared_expert_dim, self.capacity_factor, self.expert_buffer,
                       self.grouped_matmul)

  def routed_layers(self) -> tuple:
    """The layers whose MLP is routed experts."""
    dense = set(self.dense_layers or ())
    return tuple(i for i in range(self.num_layers) if self.num_experts and i not in dense)

  @nn.compact
  def __call__(self, tokens_BL: jax.Array, train: bool = False,
               positions_BL: Optional[jax.Array] = None,
               start_B: Optional[jax.Array] = None,
               segments_BL: Optional[jax.Array] = None,
               targets_BL: Optional[jax.Array] = None,
               temperature: float = 1.0, entropy: bool = False,
               last: bool = False) -> Union[jax.Array, dict]:
    """Packed documents (zoo.data.packing) give each token's `segments_BL` and its position
    in its document (`positions_BL`). With `decode=True`, `positions_BL` are the tokens'
    positions and `start_B` each row's first cache position (left padding before it); see
    zoo.models.decode. With `targets_BL`, no logits: each target's loss, whether it is the
    likeliest token and (`entropy`) the entropy it is drawn from, at `temperature`, computed
    `loss_chunks` at a time (layers.token_losses), and with
    routed experts their weighted router losses ('aux_loss') and figures ('aux_metrics').
    `last`: the last position's logits only, [B, 1, V] (a prefill: all a sampler reads;
    the other positions' are never computed, whatever the compiler would have dropped)."""
    embed_VD = layers.embedding_table(self, self.vocab_size, self.d_model, self.dtype)
    x_BLD = transformer.embed_tokens(self, embed_VD, tokens_BL)
    if self.embed_scale:  # Gemma: sqrt(d_model), in the computation dtype as HF rounds it.
      x_BLD = x_BLD * jnp.asarray(np.float32(self.d_model) ** np.float32(0.5), x_BLD.dtype)
    # Tests take gradients with respect to the embedded inputs here (see transformer_test.py).
    x_BLD = self.perturb('embedded', x_BLD)
    x_BLD = transformer.embed_positions(self, x_BLD, self.positions, self.max_len, 'pos_embed',
                                        train, positions_BL)
    stats = []  # Each routed layer's router statistics.
    x_BLD = transformer.blocks(self, x_BLD, prefix='block', train=train, causal=True,
                               rotary=self.positions == 'rotary', positions_BL=positions_BL,
                               start_B=start_B, segments_BL=segments_BL,
                               cache_length=self.cache_length or self.max_len, stats=stats)
    x_BLD = transformer.norm(self, 'ln_final')(x_BLD)
    tied = embed_VD if self.tie_embeddings else None
    if targets_BL is not None:
      out = layers.token_losses(self, x_BLD, targets_BL, self.vocab_size, self.dtype, tied,
                                self.final_softcap, self.loss_chunks, temperature, entropy)
      if stats:
        out['aux_loss'], out['aux_metrics'] = router_losses(self, stats)
      return out
    if last:
      x_BLD = x_BLD[:, -1:]
    return layers.vocab_logits(self, x_BLD, self.vocab_size, self.dtype, tied,
                               self.final_softcap)


def router_losses(model: TransformerLM, stats: list) -> tuple[jax.Array, dict]:
  """The weighted router losses and the figures logged, from each routed layer's
  statistics (zoo.models.moe.statistics). The load-balance loss pools every layer's
  tokens, as Hugging Face's load_balancing_loss_func does: E x sum_e (mean fraction of
  tokens choosing e) x (mean router probability of e), k for a balanced router."""
  stacked = jax.tree.map(lambda *v: jnp.stack(v), *stats)
  balance = model.num_experts * jnp.sum(stacked['choice'].mean(0) * stacked['prob'].mean(0))
  z = stacked['z'].mean()
  metrics = {'moe/balance_loss': balance, 'moe/z_loss': z}
  # Each layer's load: the busiest and idlest expert's share of the routed rows, 1 = even.
  load_LE = stacked['choice'] * (model.num_experts / model.experts_per_token)
  for n, i in enumerate(model.routed_layers()):
    metrics.update({f'moe/layer_{i}/load_max': load_LE[n].max(),
                    f'moe/layer_{i}/load_min': load_LE[n].min(),
                    f'moe/layer_{i}/dropped': stacked['dropped'][n],
                    f'moe/layer_{i}/entropy': stacked['entropy'][n]})
  metrics['moe/dropped'] = stacked['dropped'].mean()
  aux = model.router_aux_coef * balance + model.router_z_coef * z
  return aux, jax.tree.map(jax.lax.stop_gradient, metrics)


def train_flops(model: TransformerLM, batch_size: int, seq_len: int) -> int:
  """Analytic train-step FLOPs (zoo.run.perf's conventions): 6 N tokens + 12 layers len
  (heads x head size) tokens, N the parameters of the matmuls (blocks and output head) that
  a token meets: with routed experts, its k experts (and shared expert, router), not all."""
  d, f, h = model.d_model, model.mlp_dim, model.head_size
  attention = d * h * (2 * model.num_heads + 2 * model.kv_heads)  # q, out; k, v.
  per_unit = 3 if model.mlp_activation in ('swiglu', 'geglu') else 2
  routed = len(model.routed_layers())  # Their tokens meet k experts, a shared one, a router.
  active = (model.experts_per_token * per_unit * d * model.moe.mlp_dim + d * model.num_experts
            + (per_unit * d * model.shared_expert_dim + d if model.shared_expert_dim else 0))
  matmul_params = (model.num_layers * attention + (model.num_layers - routed) * per_unit * d * f
                   + routed * active + d * layers.padded_vocab_size(model.vocab_size))
  tokens = batch_size * seq_len
  return (6 * matmul_params * tokens
          + 12 * model.num_layers * seq_len * model.num_heads * h * tokens)


def check_inputs(m, inputs) -> None:
  """max_len covers the data, and model.loss_chunks divides its sequence length."""
  transformer.check_lengths(m, inputs)
  length = inputs[0].shape[1]
  if m.get('loss_chunks') and length % m.loss_chunks:
    fail('model.loss_chunks', f'{m.loss_chunks} does not divide the sequence length {length}; '
         'give a divisor, or 0 (auto)')


def check_config(m) -> None:
  """The Transformer's sizes and switches, and the routed experts' (zoo.models.moe)."""
  transformer.check_config(m)
  experts = m.get('num_experts', 0)
  if isinstance(experts, bool) or not isinstance(experts, int) or experts < 0:
    fail('model.num_experts', f'must be 0 (dense MLPs) or a number of experts, got {experts!r}')
  if not experts:
    return
  k = m.get('experts_per_token', 2)
  if not 1 <= k <= experts:
    fail('model.experts_per_token', f'must be in [1, model.num_experts={experts}], got {k}')
  for key in ('expert_mlp_dim', 'shared_expert_dim'):
    if m.get(key, 0) < 0:
      fail(f'model.{key}', f'must be >= 0 (0: {"mlp_dim" if key == "expert_mlp_dim" else "none"})'
           f', got {m[key]}')
  for key in ('capacity_factor', 'expert_buffer', 'router_aux_coef', 'router_z_coef'):
    if not 0 <= m.get(key, 0.0) < float('inf'):
      fail(f'model.{key}', f'must be >= 0, got {m[key]}')
  if m.get('grouped_matmul', 'auto') not in moe_lib.GROUPED_MATMULS:
    fail('model.grouped_matmul', f'unknown grouped matmul {m.grouped_matmul!r}; known: '
         f'{", ".join(moe_lib.GROUPED_MATMULS)}')
  dense = tuple(m.get('dense_layers', ()) or ())
  if not all(isinstance(i, int) and 0 <= i < m.num_layers for i in dense):
    fail('model.dense_layers', f'must list layers in [0, {m.num_layers}), got {dense!r}')
  if dense and m.get('scan_layers'):
    fail('model.dense_layers', 'scanned layers must all be alike; set model.scan_layers=False '
         'to keep dense MLPs in some layers')
  lora = m.get('lora', {})
  mlp_targets = set(lora.get('targets', ()) or ()) & {'wi_gate', 'wi_up', 'wi', 'wo'}
  if lora.get('rank', 0) and mlp_targets:
    fail('model.lora.targets', f'{sorted(mlp_targets)}: a model with routed experts takes '
         'adapters on its attention projections only (query, key, value, out)')


FAMILY = ModelFamily(TransformerLM, task='lm', check_config=check_config,
                     check_inputs=check_inputs, analytic_flops=train_flops)
