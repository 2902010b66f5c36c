"""`TextOnlyWrapper`: a multimodal checkpoint run text-only (Kimi-K2.5, Llama 4's ConditionalGeneration).

The wrapper's config.json keeps the text model's config under `text_config` and its
checkpoint keeps the text model's tensors under `language_model.` (`language_model.model.
layers...`, `language_model.lm_head.weight`); the vision tower's and projector's tensors
(`OTHER_TOWERS`) are skipped and counted. Everything else is the inner entry class's
(`INNER`, built from text_config): its layers, its plan, its checkpoint arrangement
(`checkpoint_view`), its EPLB view. The registry plans the wrapper as a `Wrapper` entry
(service/rules/entries.py) whose gate is asked with the same text_config.
"""

from __future__ import annotations

import dataclasses
import json

import torch
from torch import nn

from ..weights import WeightLayout
from .config import ConfigError


def read_text_config(parse, text_config: dict):
    """`parse(text_config)`, a refusal naming its field inside text_config (`config.text_config.<field>`)."""
    try:
        return parse(text_config)
    except ConfigError as e:
        message = str(e)
        if message.startswith("config.") and not message.startswith("config.text_config"):
            raise ConfigError("config.text_config." + message.removeprefix("config.")) from None
        raise


class TextOnlyWrapper(nn.Module):
    INNER: type = nn.Module               # the text model's entry class
    TEXT_PREFIX = "language_model."
    OTHER_TOWERS: tuple[str, ...] = ()    # checkpoint prefixes of the towers that are not run
    TENSOR_PARALLEL = False               # the inner class's, said again by each wrapper
    # (field, the value the wrapper's model runs, why): text_config fields it runs one way only, whatever the inner
    # family would read; another value is refused
    TEXT_RUNS: tuple[tuple[str, object, str], ...] = ()

    @classmethod
    def _text_config(cls, hf_config: dict) -> dict:
        text = hf_config.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"config.text_config: missing ({cls.__name__} builds its {cls.INNER.__name__} "
                              f"from it)")
        for field, runs, why in cls.TEXT_RUNS:
            if text.get(field) not in (None, runs):
                raise ConfigError(f"config.text_config.{field}: {json.dumps(text[field])} not supported; {why}")
        return dict(text, **{field: runs for field, runs, _ in cls.TEXT_RUNS}) if cls.TEXT_RUNS else text

    @classmethod
    def parse_config(cls, hf_config: dict):
        """The inner class's: text_config read as its own, a refusal naming the field inside text_config."""
        return read_text_config(cls.INNER.parse_config, cls._text_config(hf_config))

    def __init__(self, hf_config: dict, plan, *, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.plan = plan
        self.dtype = dtype
        self.language_model = self.INNER(self._text_config(hf_config), plan, dtype=dtype)
        self.config = self.language_model.config
        # The same view object: keys are global layer ids, tensors resolve through language_model.
        self.routed_experts_weights_of_layer = self.language_model.routed_experts_weights_of_layer

    def checkpoint_view(self, ckpt):
        return self.language_model.checkpoint_view(ckpt)

    def weight_layout(self) -> WeightLayout:
        inner = self.language_model.weight_layout(prefix=self.TEXT_PREFIX)
        return dataclasses.replace(inner, ignore_prefixes=self.OTHER_TOWERS + inner.ignore_prefixes)

    def tie_weights(self) -> None:
        self.language_model.tie_weights()

    def stage_carry(self) -> list[torch.Tensor]:
        return self.language_model.stage_carry()

    def take_stage_carry(self, tensors: list[torch.Tensor]) -> None:
        self.language_model.take_stage_carry(tensors)

    def setup_caches(self, max_batch_size: int, max_seq_len: int, lookahead: int = 0) -> None:
        self.language_model.setup_caches(max_batch_size, max_seq_len, lookahead)

    def clear_caches(self) -> None:
        self.language_model.clear_caches()

    def forward(self, input_ids: torch.Tensor | None = None, input_pos: torch.Tensor | None = None, *,
                hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        return self.language_model(input_ids, input_pos, hidden_states=hidden_states)

    def logits_and_hidden(self, input_ids: torch.Tensor | None = None, input_pos: torch.Tensor | None = None, *,
                          hidden_states: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.language_model.logits_and_hidden(input_ids, input_pos, hidden_states=hidden_states)
