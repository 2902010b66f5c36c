"""The engine's model families: a class hierarchy with hooks, and the families that differ only by data as rows.

`causal_lm.CausalLM` is the shell every entry class derives from: the plan's pipeline stage, embedding / final norm /
(tied) head, rotary tables, expert-weights view, `weight_layout`, caches and the forward across stages.
`causal_lm.DecoderLayer` is the pre-norm block the layers derive from. A family overrides hooks where its model
differs: the model's `_embed`, `_head`, `checkpoint_view`, `MTP_PREFIXES`, `stage_carry`; a layer's
(`causal_lm.BlockLayer`) `make_attention`, `make_mlp`, `MOE_BLOCK`, `NORM`, `mixer`, `forward`. Its config is a dataclass deriving from
`config.DecoderConfig`. Families that differ only by field names, defaults and which blocks they use are rows: a
`config.Family` names the registry's layout reader, the config.json fields with transformers' defaults, what the
family fixes and what it reads its own way, read once by `Family.read`; the entry class declares its `FAMILY`,
`CONFIG` and `DECODER_LAYER` (`causal_lm.DeclaredCausalLM`; qwen_moe.py's `QWEN_FAMILIES`, mixtral.py, olmoe.py).
A family keeps code of its own only for what is really its own (an attention, a router, a layer's arithmetic).

Conventions every entry class follows (the loader relies on them; see qwen_moe.py):

Construction
- `Cls(hf_config: dict, plan: GuardedPlan, *, dtype=torch.float32)`: `hf_config`
  is config.json as a dict; a wrapper hands `hf_config[config_field]` to its inner
  class (`engine.registry.ENGINE_WRAPPERS`). Parse it into a config dataclass
  (its `Family` row, or `from_hf`) that names every field the family uses and refuses
  what it cannot run (e.g. sliding windows) with a message naming the field. The entry class's
  classmethod `parse_config(hf_config)` returns it: the loader calls it before the
  plan is resolved, so a config the family cannot run records no plan.
- The loader builds the model under `torch.device("meta")`. Layers read the plan
  (`plan.decisions[Keys.X].value`) in their constructor and keep what they need as
  plain attributes; reading the plan during forward raises (plan_guard.py). Model
  code never names an a2a backend: it reads `moe.forward_path` and
  `moe.post_experts_all_reduce` (engine/moe.py does).
- Ranks come from `plan.request.parallel`. Layer ids are GLOBAL: `self.model.layers`
  has one entry per config layer; layers outside `pp.layer_range` are
  `PPMissingLayer` placeholders (no parameters, no mlp). The embedding exists on
  the first stage only, the final norm and lm_head on the last.
- Routed experts are `engine.moe.RoutedExperts` at `<layer>.mlp.experts`, stacked
  `gate_up_proj [E+S, 2I, D]` and `down_proj [E+S, D, I]`; fused shared experts
  are extra slots after the local routed ones (`append_shared_slots`).
- `self.routed_experts_weights_of_layer` is set in the constructor to an
  `ExpertWeightsView` ({global layer id: [expert tensors]}, local MoE layers only,
  fused slots excluded). It resolves tensors on access, so it stays right when the
  loader assigns new parameters and when a path bypasses `load_weights`.
- No buffers that a checkpoint does not hold (they would stay on meta): the
  rotary tables are plain tensors (layers/rope.py); KV caches are made by
  `setup_caches`.

Loading
- `weight_layout() -> engine.weights.WeightLayout`: what the name remapping needs
  (n_routed, fused slots, local experts, stage, tied head, ignored prefixes).
  Checkpoint names follow the Hub; engine parameter names equal them except for the
  stacked experts (engine/weights.py, RULES), so most models need nothing else. A family
  whose checkpoints spell tensors otherwise sets `CHECKPOINT_NAMES` (a
  `weights.CheckpointNames` table; mixtral.py).
- `checkpoint_view(ckpt)` (causal_lm.CausalLM: the checkpoint as it is): a family whose
  checkpoints arrange tensors otherwise shows them to the remapping in the engine's
  arrangement (gpt_oss.py: its stacked, interleaved experts one expert at a time).
- `tie_weights()`: called after the state dict is assigned (tied embeddings).

Running
- `forward(input_ids [B, T], input_pos [T] | None = None) -> logits [B, T, V]`,
  entering `plan.forward_running()`. On a stage that is not the first, pass
  `hidden_states=[B, T, D]` instead; a stage that is not the last returns hidden states.
- `setup_caches(max_batch_size, max_seq_len, lookahead=0)` / `clear_caches()`: a static KV
  cache (a sliding-window layer's a ring of window + lookahead slots, layers/kv_cache.py; a
  linear-attention layer's its recurrent states, the last lookahead + 2 of them,
  layers/gated_delta_net.py), held by each layer's token mixer (`DecoderLayer.mixer`);
  with it, `input_pos` (absolute positions of the new tokens) is required.
- `logits_and_hidden(input_ids, input_pos)` (causal_lm.CausalLM, last stage): the logits
  and the final hidden states, what a Multi-Token-Prediction draft drafts from. Such a
  draft (nextn.py: deepseek_nextn.py, glm4_moe_nextn.py) says `drafts_from_target_hidden = True` and takes
  `hidden_states=[B, T, D]` with its tokens; it is never a target.

Several ranks (engine/worker.py)
- A model never creates or looks up process groups. The worker sets the process's
  parallel context (engine/parallel/context.py) before building; `RoutedExperts`
  takes its EP group from it at construction, like a plan decision. The layer runs
  the plan's path: `normal` = local partial sums + one all-reduce iff
  `moe.post_experts_all_reduce`; `a2a` = dispatch / compute / combine, complete
  rows, no further reduction. An unfused shared expert is the model's: add it
  AFTER `self.experts(...)` returns (replicated, never summed once per rank).
- Tensor parallelism (plan tp_size > 1): a family whose layers split themselves says
  `TENSOR_PARALLEL = True` (the loader refuses the others before any plan). Its
  attention and dense MLPs take `TensorParallel.of(plan)` (engine/parallel/tensor.py:
  heads and intermediate features split, one all-reduce over the TP group after the last
  projection); on the normal path `RoutedExperts` splits every expert's intermediate
  features and runs the planned all-reduce over the TP group (with EP too: over the
  stage, `Grid.experts_group`), on the a2a path it keeps them whole (complete rows from
  the combine; `WeightLayout.tp_split_experts`); embedding, router, norms, lm_head and unfused shared experts
  stay whole. `engine.weights.TP_SPLITS` names the split checkpoint tensors.
- A stage model runs only its own layers; `engine.parallel.pipeline.PipelineModel`
  chains the stages (hidden states over p2p, logits broadcast from the last stage)
  so decoding loops see one model on every rank. KV caches are per stage.
- EPLB (plan `eplb.enabled`): each `RoutedExperts` keeps a `placement` (physical
  slot -> logical expert; slot p holds expert p % n_routed at load) and a
  `load_counter`; `weight_layout()` passes `num_physical` so the loader fills every
  local replica. `engine.rebalance.rebalance(model)` moves weights through
  `routed_experts_weights_of_layer` and records `eplb.placement` in the registry.
"""

from __future__ import annotations

from typing import Iterator, Mapping

import torch
from torch import nn


class PPMissingLayer(nn.Module):
    """A decoder layer another pipeline stage owns: no parameters, never run here."""

    def __init__(self, layer_id: int):
        super().__init__()
        self.layer_id = layer_id

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"layer {self.layer_id} belongs to another pipeline stage")

    def extra_repr(self) -> str:
        return f"layer={self.layer_id} (other stage)"


class ExpertWeightsView(Mapping[int, list[torch.Tensor]]):
    """{global layer id: experts.get_moe_weights()} for the local MoE layers, resolved on access."""

    def __init__(self, experts_of_layer: Mapping[int, nn.Module]):
        self._experts = dict(experts_of_layer)

    def __getitem__(self, layer_id: int) -> list[torch.Tensor]:
        return self._experts[layer_id].get_moe_weights()

    def __iter__(self) -> Iterator[int]:
        return iter(self._experts)

    def __len__(self) -> int:
        return len(self._experts)

    def __repr__(self) -> str:
        return f"ExpertWeightsView(layers={list(self._experts)})"
