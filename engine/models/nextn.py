"""A Multi-Token-Prediction (MTP) layer as a speculative draft: the NextN runners of DeepSeek-V3 and GLM-4-MoE, and
Qwen3-Next's (its checkpoint names the same parts otherwise: models/qwen3_next_nextn.py).

Shapes: B batch, T tokens, D hidden, V vocab. L = num_hidden_layers (the target's).

At position i the draft joins the target's final hidden state h_i (after the target's
final norm) with the embedding of the next token t_{i+1}, and predicts t_{i+2}
(DeepSeek-V3 technical report, 2.2; GLM-4.5 ships the same module):

    x      = eh_proj(cat(enorm(embed(t_{i+1})), hnorm(h_i)))    # [B, T, 2D] -> [B, T, D]
    x      = decoder layer L (the family's attention and MoE block, over the draft's own positions)
    out    = shared_head.norm(x)                                # [B, T, D]
    logits = shared_head.head(out)                              # [B, T, V]

A further draft step at position i+1 takes `out` at i in place of h_i (engine/speculative.py).

Where the references differ we follow SGLang, whose entry-class names the registry uses
(service/rules/entries.py): the recursive step takes the draft's normed output (vLLM
takes it before shared_head.norm), and position 0's embedding is kept (vLLM zeroes it).
transformers has no MTP module; tests/engine/models/test_*_nextn.py check these against
transformers' own decoder layer, norms and rotary of the family composed as above.

Checkpoint: the family's own layout, the target's folder. MTP layer j is
`model.layers.{L + j}.*`: a decoder layer of the family (always MoE) plus `enorm`,
`hnorm`, `eh_proj`, `shared_head.{norm,head}` and its own `embed_tokens` (described as
shared with the target's: without the layer's copies, the target's `model.embed_tokens`
and `lm_head` are read). config.json is the target's with the draft's entry class in
`architectures` (the registry plans it as its own runner, role `speculative`, with its
own fusion decision). The target's own tensors in the folder are not this model's and
are skipped. Both families ship one MTP layer; more are refused by field.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from loadplan.plan import Keys
from ..layers.norm import RMSNorm
from ..layers.rope import RotaryEmbedding
from ..weights import WeightLayout
from . import ExpertWeightsView, PPMissingLayer
from .causal_lm import DecoderLayer
from .config import ConfigError


class SharedHead(nn.Module):
    """`shared_head.`: the MTP layer's final norm and vocabulary projection."""

    def __init__(self, hidden_size: int, vocab_size: int, eps: float, dtype: torch.dtype,
                 norm: type[RMSNorm] = RMSNorm):
        super().__init__()
        self.norm = norm(hidden_size, eps, dtype)
        self.head = nn.Linear(hidden_size, vocab_size, bias=False, dtype=dtype)


class MultiTokenPredictionLayer(DecoderLayer):
    """`model.layers.{L}`: the family's decoder layer `block` (its attention and MoE block, adopted) with
    the MTP inputs and head around it; every norm of the family's kind (`NORM` of its decoder layer)."""

    def __init__(self, block: DecoderLayer, cfg, dtype: torch.dtype):
        self.NORM = type(block).NORM
        super().__init__(block.layer_id, block.self_attn, block.mlp, cfg.hidden_size, cfg.rms_norm_eps, dtype)
        D = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, D, dtype=dtype)
        self.enorm = self.NORM(D, cfg.rms_norm_eps, dtype)
        self.hnorm = self.NORM(D, cfg.rms_norm_eps, dtype)
        self.eh_proj = nn.Linear(2 * D, D, bias=False, dtype=dtype)
        self.shared_head = SharedHead(D, cfg.vocab_size, cfg.rms_norm_eps, dtype, self.NORM)

    def predict(self, input_ids, hidden_states, cos, sin, input_pos) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [B, T] (t_{i+1}), hidden_states [B, T, D] (h_i) -> (logits [B, T, V], out [B, T, D])"""
        e = self.enorm(self.embed_tokens(input_ids))                       # [B, T, D]
        x = self.eh_proj(torch.cat((e, self.hnorm(hidden_states.to(e.dtype))), dim=-1))
        out = self.shared_head.norm(super().forward(x, cos, sin, input_pos))
        return self.shared_head.head(out), out


def mtp_config(cfg):
    """A draft's config `cfg` (a family config dataclass read with the registry's draft layout: its MoE layers are
    the MTP layers, numbered from the target's num_hidden_layers) as the engine builds it: the one MTP layer."""
    if len(cfg.moe_layers) != 1:
        raise ConfigError(f"config.num_nextn_predict_layers: {len(cfg.moe_layers)} not supported by the engine; "
                          f"supported: 1 (the one MTP layer DeepSeek-V3/R1 and GLM-4.5 ship)")
    return dataclasses.replace(cfg, num_nextn_predict_layers=1)


class NextNDraft(nn.Module):
    """The MTP draft runner. `model(input_ids [B, T], input_pos, hidden_states=[B, T, D]) -> logits [B, T, V]`;
    `logits_and_hidden(...)` also returns the output a further draft step takes as its hidden states.
    A family's draft gives its config (`mtp_config` of the family's), its decoder layer class and the
    width its rotary embedding covers."""

    ARCHITECTURE = ""
    # engine/speculative.py: this draft takes the target's final hidden states with the tokens.
    drafts_from_target_hidden = True
    TENSOR_PARALLEL = True            # its decoder layer's; eh_proj, norms, embedding and head whole

    @classmethod
    def parse_config(cls, hf_config: dict):
        """As `CausalLM.parse_config`: the family's config with its MTP layer (`mtp_config`)."""
        raise NotImplementedError(f"{cls.__name__} does not say how it reads its config (parse_config)")

    def __init__(self, cfg, plan, decoder_layer: type[DecoderLayer], rope_dim: int, dtype: torch.dtype,
                 n_routed: int | None = None):
        """`n_routed`: the routed experts (default: the DeepSeek-style config's n_routed_experts)."""
        super().__init__()
        self.config = cfg
        self.plan = plan
        self.dtype = dtype
        self.n_routed = cfg.n_routed_experts if n_routed is None else n_routed
        L = cfg.num_hidden_layers
        lo, hi = (int(v) for v in plan.decisions[Keys.PP_LAYER_RANGE].value)
        if (lo, hi) != (L, L + 1):
            raise ValueError(f"plan's pp.layer_range [{lo}, {hi}) is not the MTP layer [{L}, {L + 1}) "
                             f"(a NextN draft is one pipeline stage)")
        self.layer_range = (L, L + 1)
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([*(PPMissingLayer(i) for i in range(L)),
                                           MultiTokenPredictionLayer(decoder_layer(cfg, plan, L, dtype), cfg, dtype)])
        self.rotary = RotaryEmbedding(rope_dim, cfg.rope, cfg.max_position_embeddings)
        self.moe_layer_ids = (L,)
        self.routed_experts_weights_of_layer = ExpertWeightsView({L: self.mtp.mlp.experts})
        if plan.decisions[Keys.EPLB_ENABLED].value:
            eplb_layers = [int(i) for i in plan.decisions[Keys.EPLB_LAYERS].value]
            if eplb_layers != [L]:
                raise ValueError(f"plan's eplb.layers {eplb_layers} are not the MTP layer [{L}]")

    @property
    def mtp(self) -> MultiTokenPredictionLayer:
        return self.model.layers[self.config.num_hidden_layers]

    # -- loading ---------------------------------------------------------------
    def weight_layout(self) -> WeightLayout:
        mtp = f"model.layers.{self.config.num_hidden_layers}."
        return WeightLayout(
            n_routed=self.n_routed, **self.mtp.mlp.experts.weight_layout_fields(),
            # The target's decoder layers fall outside the range (the target runner holds them); its
            # embedding, final norm and head are named here: the MTP layer has its own.
            layer_range=self.layer_range, has_embed=True, has_head=False,
            ignore_prefixes=("model.embed_tokens.", "model.norm.", "lm_head."),
            # The MTP layer's embedding and head are described as shared with the target's: a checkpoint
            # without the layer's own copies gives the target's.
            shared_from=((f"{mtp}embed_tokens.weight", "model.embed_tokens.weight"),
                         (f"{mtp}shared_head.head.weight", "lm_head.weight")),
            tp_size=self.plan.request.parallel.tp_size, tp_rank=self.plan.request.parallel.tp_rank)

    def tie_weights(self) -> None:
        pass

    # -- running ---------------------------------------------------------------
    def setup_caches(self, max_batch_size: int, max_seq_len: int, lookahead: int = 0) -> None:
        self.mtp.mixer.setup_cache(max_batch_size, max_seq_len, self.dtype, next(self.parameters()).device,
                                   lookahead)

    def clear_caches(self) -> None:
        self.mtp.mixer.kv_cache = None

    def logits_and_hidden(self, input_ids: torch.Tensor, input_pos: torch.Tensor | None = None, *,
                          hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [B, T]: t_{i+1} at positions i = input_pos; hidden_states [B, T, D]: h_i (the target's,
        after its final norm, or this model's previous output) -> (logits [B, T, V] for t_{i+2}, out [B, T, D])"""
        if hidden_states is None or hidden_states.shape[:2] != input_ids.shape:
            raise ValueError(f"a NextN draft takes hidden_states [B, T, D] with input_ids [B, T] = "
                             f"{list(input_ids.shape)}, got "
                             f"{None if hidden_states is None else list(hidden_states.shape)}")
        with self.plan.forward_running():
            T = input_ids.shape[1]
            if input_pos is None:
                input_pos = torch.arange(T, device=input_ids.device)
            cos, sin = self.rotary(input_pos)                              # [T, rope_dim] each
            return self.mtp.predict(input_ids, hidden_states, cos, sin, input_pos)

    def forward(self, input_ids: torch.Tensor, input_pos: torch.Tensor | None = None, *,
                hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_and_hidden(input_ids, input_pos, hidden_states=hidden_states)[0]
