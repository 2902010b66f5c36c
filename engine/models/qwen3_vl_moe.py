"""Qwen3-VL-MoE (Qwen3-VL-30B-A3B, Qwen3-VL-235B-A22B) run text-only: its text model is Qwen3-MoE's.

With text alone the multimodal rotary embedding (MRoPE: head features split into temporal,
height and width sections, `rope_parameters.mrope_section`) reduces to the plain one: a text
token's three position ids are equal, so every section rotates by the same position, which
is what `Qwen3MoeForCausalLM` does (checked against transformers' whole model in the tests).

It differs from the other wrappers in three ways:
- names (`checkpoint_view`): the text body is `model.language_model.{layers,embed_tokens,norm}...` and the head
  `lm_head.weight`, the vision tower `model.visual...` (skipped);
- routing: its router always renormalises the top-k weights (transformers' Qwen3VLMoeTextTopKRouter
  has no norm_topk_prob), so the text config is read with norm_topk_prob true, and one that
  says false is refused;
- experts (`checkpoint_view`): stacked per layer with gate and up concatenated, `mlp.experts.gate_up_proj` and
  `down_proj`, either transposed for x @ W as the Hub's files are ([E, D, 2I], [E, I, D]) or
  as transformers holds them ([E, 2I, D], [E, D, I]): engine/stacked_experts.py.
"""

from __future__ import annotations

from ..shown_tensors import renamed
from ..stacked_experts import StackedExperts
from .qwen_moe import Qwen3MoeForCausalLM
from .text_wrapper import TextOnlyWrapper

# checkpoint prefix -> the wrapper's (its text model under `language_model.`, as TextOnlyWrapper keeps it)
PREFIXES = (("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."))


class Qwen3VLMoeForConditionalGeneration(TextOnlyWrapper):
    INNER = Qwen3MoeForCausalLM
    TENSOR_PARALLEL = True
    OTHER_TOWERS = ("model.visual.",)
    TEXT_RUNS = (("norm_topk_prob", True, "Qwen3-VL-MoE's router always renormalises its top-k weights"),)

    def checkpoint_view(self, ckpt):
        cfg = self.config
        return StackedExperts(renamed(ckpt, PREFIXES), cfg.num_experts, gate_up="concatenated",
                              hidden_size=cfg.hidden_size, expert_width=cfg.moe_intermediate_size)
