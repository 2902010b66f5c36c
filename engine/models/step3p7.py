"""Step-3.7 (`Step3p7ForConditionalGeneration`: StepFun's Step-3.7-Flash) run text-only: its text model is
Step-3.5's (models/step3p5.py), built from `text_config`.

Its checkpoints keep the text model as Step-3.5's own do (`model.{embed_tokens,layers,norm}`, `lm_head`: the Hub's
spelling, which transformers' save keeps) beside the vision tower (`vision_model.`) and its projector
(`vit_large_projector.`), which are skipped. Whether its head is the embedding is the wrapper config's
`tie_word_embeddings` (absent: not), whatever text_config says, as transformers ties it.
"""

from __future__ import annotations

from ..shown_tensors import renamed
from .step3p5 import Step3p5ForCausalLM
from .text_wrapper import TextOnlyWrapper

# checkpoint prefix -> the wrapper's (its text model under `language_model.`, as TextOnlyWrapper keeps it)
PREFIXES = (("model.", "language_model.model."), ("lm_head.", "language_model.lm_head."))


class Step3p7ForConditionalGeneration(TextOnlyWrapper):
    INNER = Step3p5ForCausalLM
    TENSOR_PARALLEL = True
    OTHER_TOWERS = ("vision_model.", "vit_large_projector.")

    @classmethod
    def _text_config(cls, hf_config: dict) -> dict:
        return dict(super()._text_config(hf_config), tie_word_embeddings=hf_config.get("tie_word_embeddings", False))

    def checkpoint_view(self, ckpt):
        return self.language_model.checkpoint_view(renamed(ckpt, PREFIXES))
