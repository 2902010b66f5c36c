"""GLM-4.5V (`Glm4vMoeForConditionalGeneration`) run text-only: its text model is GLM-4-MoE's (models/glm4_moe.py).

Following transformers' modeling_glm4v_moe: the text decoder is GLM-4-MoE's layer (its MoE block, routing and
shared expert alike) with GLM-4's attention: q/k/v biased, o_proj not, partial rotary over the two halves of
the rotated part, and no q/k norm. Its multimodal rotary embedding (MRoPE: the rotated features split into
temporal, height and width sections, `rope_parameters.mrope_section`) reduces to the plain one with text alone:
a text token's three position ids are equal (as Qwen3-VL-MoE's, models/qwen3_vl_moe.py).

The checkpoint keeps the text body under `model.language_model.`, the head at `lm_head.` and the vision tower
under `model.visual.` (skipped). `use_qk_norm`, which transformers' GLM-4.5V text config does not have, is
refused when true (the checkpoints hold no q/k norm weights; transformers would ignore the field).
"""

from __future__ import annotations

from ..shown_tensors import renamed
from .glm4_moe import Glm4MoeForCausalLM
from .qwen3_vl_moe import PREFIXES
from .text_wrapper import TextOnlyWrapper


class Glm4vMoeForConditionalGeneration(TextOnlyWrapper):
    INNER = Glm4MoeForCausalLM
    TENSOR_PARALLEL = True
    OTHER_TOWERS = ("model.visual.",)
    TEXT_RUNS = (("use_qk_norm", False, "GLM-4.5V's attention has no q/k norm (transformers' GLM-4.5V ignores the "
                                        "field)"),)

    def checkpoint_view(self, ckpt):
        return self.language_model.checkpoint_view(renamed(ckpt, PREFIXES))
