"""The causal-LM shell the model families share (conventions: engine/models/__init__.py).

A family file writes its config dataclass, its attention and MLP/MoE blocks and a
`DecoderLayer` subclass that builds them; `CausalLM` does the rest the same way for
every family: the plan's pipeline stage (`pp.layer_range`), `model.{embed_tokens,
layers, norm}` for that stage, the (tied) head, the rotary tables, the expert-weights
view, the loading layout, the KV caches and the forward across stages.

The config dataclass is a `config.DecoderConfig` (vocab_size, hidden_size, num_hidden_layers, rms_norm_eps,
max_position_embeddings, tie_word_embeddings, rope) that also names moe_layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loadplan.plan import Keys
from ..layers.norm import RMSNorm
from ..layers.rope import RotaryEmbedding
from ..parallel.tensor import TensorParallel
from ..weights import CheckpointNames, WeightLayout
from . import ExpertWeightsView, PPMissingLayer


class DecoderLayer(nn.Module):
    """Pre-norm block: x + mixer(norm(x)), then x + mlp(norm(x)); the mlp sees the tokens flattened [B*T, D].
    The token mixer (`mixer`: attention, `self_attn`, unless a family says otherwise) has `setup_cache(batch,
    max_seq_len, dtype, device, lookahead)` and a `kv_cache` attribute. `NORM`: the norms' class, the model's
    final norm's too. `rotary`: the layer's own rotary tables, where its kind has a rope of its own (MiMo-V2-Flash's,
    Granite MoE SWA's): the model hands it those instead of its own."""

    NORM: type[RMSNorm] = RMSNorm

    def __init__(self, layer_id: int, self_attn: nn.Module, mlp: nn.Module, hidden_size: int,
                 rms_norm_eps: float, dtype: torch.dtype):
        super().__init__()
        self.layer_id = layer_id
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = self.NORM(hidden_size, rms_norm_eps, dtype)
        self.post_attention_layernorm = self.NORM(hidden_size, rms_norm_eps, dtype)
        self.rotary: RotaryEmbedding | None = None    # a subclass's own tables (a submodule once set)

    @property
    def mixer(self) -> nn.Module:
        """The module that mixes tokens and holds the layer's cache."""
        return self.self_attn

    def forward(self, x, cos, sin, input_pos=None):
        """x [B, T, D] -> [B, T, D]"""
        x = x + self.mixer(self.input_layernorm(x), cos, sin, input_pos)
        B, T, D = x.shape
        h = self.post_attention_layernorm(x).reshape(B * T, D)
        return x + self.mlp(h).view(B, T, D)


class BlockLayer(DecoderLayer):
    """A `DecoderLayer` of config `cfg` built by two hooks, each given the TP ranks `tp` (engine/parallel/tensor.py)
    that its heads and dense features split over: `make_attention`, the token mixer, and `make_mlp`, the MLP or MoE
    block (the routed experts split themselves: engine/moe.py)."""

    @classmethod
    def make_attention(cls, cfg, layer_id: int, dtype: torch.dtype, tp: TensorParallel) -> nn.Module | None:
        raise NotImplementedError(f"{cls.__name__} does not say how it builds its token mixer (make_attention)")

    @classmethod
    def make_mlp(cls, cfg, plan, layer_id: int, dtype: torch.dtype, tp: TensorParallel) -> nn.Module:
        raise NotImplementedError(f"{cls.__name__} does not say how it builds its MLP (make_mlp)")

    def __init__(self, cfg, plan, layer_id: int, dtype: torch.dtype):
        tp = TensorParallel.of(plan)
        super().__init__(layer_id, self.make_attention(cfg, layer_id, dtype, tp),
                         self.make_mlp(cfg, plan, layer_id, dtype, tp), cfg.hidden_size, cfg.rms_norm_eps, dtype)


class DecoderModel(nn.Module):
    """`model.`: embed_tokens (first stage only), one entry per config layer (this stage's built by
    `decoder_layer(cfg, plan, layer_id, dtype)`, the others PPMissingLayer), norm (last stage only)."""

    def __init__(self, cfg, plan, decoder_layer: type[DecoderLayer], layer_range: tuple[int, int], first: bool,
                 last: bool, dtype: torch.dtype):
        super().__init__()
        lo, hi = layer_range
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype) if first else None
        self.layers = nn.ModuleList(decoder_layer(cfg, plan, i, dtype) if lo <= i < hi else PPMissingLayer(i)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = decoder_layer.NORM(cfg.hidden_size, cfg.rms_norm_eps, dtype) if last else None


class CausalLM(nn.Module):
    """One pipeline stage of a decoder-only MoE LM. A family's entry class parses its config and calls
    `super().__init__(cfg, plan, its DecoderLayer, n_routed=..., rope_head_dim=..., dtype=dtype)`.
    `TENSOR_PARALLEL`: the family's layers split themselves over the plan's TP ranks
    (engine/parallel/tensor.py) and `weights.TP_SPLITS` names their split tensors; the loader
    refuses tp_size > 1 for the others. `CHECKPOINT_NAMES`: where the family's checkpoints spell a tensor
    otherwise than the engine (weights.CheckpointNames)."""

    TENSOR_PARALLEL = False
    CHECKPOINT_NAMES: CheckpointNames | None = None   # the family's own checkpoint spellings (weights.py)
    MTP_PREFIXES: tuple[str, ...] = ()   # where the family's checkpoints keep MTP modules apart (not loaded)

    @classmethod
    def parse_config(cls, hf_config: dict):
        """config.json read as the family's config dataclass, refusing what the family cannot run by field.
        The loader calls it before the plan is resolved (no plan is recorded for a runner that cannot be
        built); the entry class's constructor builds from it."""
        raise NotImplementedError(f"{cls.__name__} does not say how it reads its config (parse_config)")

    def __init__(self, cfg, plan, decoder_layer: type[DecoderLayer], *, n_routed: int, rope_head_dim: int,
                 dtype: torch.dtype):
        super().__init__()
        self.config = cfg
        self.plan = plan
        self.dtype = dtype
        self.n_routed = n_routed
        lo, hi = (int(v) for v in plan.decisions[Keys.PP_LAYER_RANGE].value)
        if not 0 <= lo < hi <= cfg.num_hidden_layers:
            raise ValueError(f"plan's pp.layer_range [{lo}, {hi}) is outside the config's "
                             f"{cfg.num_hidden_layers} layers")
        self.layer_range = (lo, hi)
        self.is_first_stage, self.is_last_stage = lo == 0, hi == cfg.num_hidden_layers
        self.model = DecoderModel(cfg, plan, decoder_layer, self.layer_range, self.is_first_stage,
                                  self.is_last_stage, dtype)
        # Tied embeddings on a single stage: the head reads the embedding's weight (no lm_head parameter).
        separate_head = self.is_last_stage and not (cfg.tie_word_embeddings and self.is_first_stage)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype) if separate_head else None
        self.rotary = RotaryEmbedding(rope_head_dim, cfg.rope, cfg.max_position_embeddings)
        self.moe_layer_ids = tuple(i for i in cfg.moe_layers if lo <= i < hi)
        self.routed_experts_weights_of_layer = ExpertWeightsView(
            {i: self.model.layers[i].mlp.experts for i in self.moe_layer_ids})
        if plan.decisions[Keys.EPLB_ENABLED].value:
            eplb_layers = [int(i) for i in plan.decisions[Keys.EPLB_LAYERS].value]
            if eplb_layers != list(self.moe_layer_ids):
                raise ValueError(f"plan's eplb.layers {eplb_layers} differ from this stage's MoE layers "
                                 f"{list(self.moe_layer_ids)}")

    # -- loading ---------------------------------------------------------------
    def ignore_prefixes(self, prefix: str) -> tuple[str, ...]:
        """Checkpoint name prefixes that are not part of this model: the Multi-Token-Prediction layers a
        checkpoint stores after the last decoder layer (`model.layers.{L + i}.`, DeepSeek's, GLM's and
        MiniMax-M2's convention), as many as the config's `num_nextn_predict_layers` (0 where it has none), and
        the family's `MTP_PREFIXES` (its MTP module stored apart: `mtp.`)."""
        L = self.config.num_hidden_layers
        n = getattr(self.config, "num_nextn_predict_layers", 0)
        return (*(f"{prefix}model.layers.{L + i}." for i in range(n)), *(prefix + p for p in self.MTP_PREFIXES))

    def checkpoint_view(self, ckpt):
        """The checkpoint as the weight remapping reads it (`names`, `shape`, `get`): as it is, unless the family
        keeps tensors in another arrangement (gpt-oss's stacked experts, models/gpt_oss.py)."""
        return ckpt

    def weight_layout(self, prefix: str = "") -> WeightLayout:
        """`prefix`: where a wrapper keeps this model in its checkpoint (e.g. "language_model.")."""
        experts = {}     # no MoE layer on this stage: WeightLayout's defaults
        if self.moe_layer_ids:
            experts = self.model.layers[self.moe_layer_ids[0]].mlp.experts.weight_layout_fields()
        return WeightLayout(
            n_routed=self.n_routed, **experts,
            layer_range=self.layer_range, n_layers=self.config.num_hidden_layers, has_embed=self.is_first_stage,
            has_head=self.is_last_stage,
            lm_head_from_embed=self.config.tie_word_embeddings and self.is_last_stage and not self.is_first_stage,
            ignore_prefixes=self.ignore_prefixes(prefix),
            tp_size=self.plan.request.parallel.tp_size, tp_rank=self.plan.request.parallel.tp_rank,
            names=self.CHECKPOINT_NAMES)

    def tie_weights(self) -> None:
        pass  # a tied head reads model.embed_tokens.weight directly (see _head)

    # -- running ---------------------------------------------------------------
    def setup_caches(self, max_batch_size: int, max_seq_len: int, lookahead: int = 0) -> None:
        """`lookahead`: how far past the tokens it keeps a caller writes (a speculative round: its draft tokens
        and one more); a sliding-window layer's ring keeps that many positions beyond its window."""
        device = next(self.parameters()).device
        lo, hi = self.layer_range
        for layer in self.model.layers[lo:hi]:
            if layer.mixer is not None:   # None: a layer without a token mixer (Nemotron-H's MLP / MoE layers)
                layer.mixer.setup_cache(max_batch_size, max_seq_len, self.dtype, device, lookahead)

    def clear_caches(self) -> None:
        lo, hi = self.layer_range
        for layer in self.model.layers[lo:hi]:
            if layer.mixer is not None:
                layer.mixer.kv_cache = None

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] -> [B, T, D]: the embedding (a family that scales it overrides this: granitemoe.py)."""
        return self.model.embed_tokens(input_ids)

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        w = self.lm_head.weight if self.lm_head is not None else self.model.embed_tokens.weight
        return F.linear(h, w)

    def forward(self, input_ids: torch.Tensor | None = None, input_pos: torch.Tensor | None = None, *,
                hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, T] (first stage) or hidden_states [B, T, D] -> logits [B, T, V] (last stage)."""
        with self.plan.forward_running():
            x = self._layers(input_ids, input_pos, hidden_states)
            if not self.is_last_stage:
                return x
            return self._head(self.model.norm(x))                          # [B, T, V]

    def logits_and_hidden(self, input_ids: torch.Tensor | None = None, input_pos: torch.Tensor | None = None, *,
                          hidden_states: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, also returning the final hidden states [B, T, D] (after the final norm): what a
        Multi-Token-Prediction draft (models/nextn.py) drafts from. Last stage only."""
        if not self.is_last_stage:
            raise ValueError(f"pipeline stage {self.layer_range} has no final hidden states (not the last stage)")
        with self.plan.forward_running():
            h = self.model.norm(self._layers(input_ids, input_pos, hidden_states))
            return self._head(h), h

    # -- between pipeline stages (engine/parallel/pipeline.py) --------------------
    def stage_carry(self) -> list[torch.Tensor]:
        """What this stage's forward leaves for the next stage's besides its hidden states (none here; GLM-5's
        latest top-k selection: models/deepseek_v3.py)."""
        return []

    def take_stage_carry(self, tensors: list[torch.Tensor]) -> None:
        """What the previous stage's `stage_carry` gave, before this stage's forward."""
        if tensors:
            raise ValueError(f"pipeline stage {self.layer_range} takes nothing besides hidden states, got "
                             f"{len(tensors)} more tensors")

    def _layers(self, input_ids, input_pos, hidden_states) -> torch.Tensor:
        """This stage's layers over the embedded input_ids, or over hidden_states: [B, T, D]."""
        if self.is_first_stage:
            if input_ids is None:
                raise ValueError("the first pipeline stage takes input_ids")
            x = self._embed(input_ids)                                     # [B, T, D]
        else:
            if hidden_states is None:
                raise ValueError(f"pipeline stage {self.layer_range} takes hidden_states")
            x = hidden_states
        T = x.shape[1]
        if input_pos is None:
            input_pos = torch.arange(T, device=x.device)
        cos, sin = self.rotary(input_pos)                                  # [T, rotary_dim] each
        lo, hi = self.layer_range
        for layer in self.model.layers[lo:hi]:
            if layer.rotary is None:
                x = layer(x, cos, sin, input_pos)
            else:                                                          # its kind's own tables
                x = layer(x, *layer.rotary(input_pos), input_pos)
        return x


class DeclaredCausalLM(CausalLM):
    """An entry class declared by class attributes: `CONFIG`, its config dataclass (naming num_experts and head_dim),
    read as its row `FAMILY` says (`config.Family`), or by `CONFIG.from_hf(config.json)` where it has none; and
    `DECODER_LAYER`, its layer class (gpt_oss.py, minimax_m2.py, llama4.py, the Qwen-layer families)."""

    CONFIG: type = type(None)
    FAMILY = None                     # a config.Family: the family as data
    DECODER_LAYER: type[DecoderLayer] = DecoderLayer

    @classmethod
    def parse_config(cls, hf_config: dict):
        return cls.CONFIG.from_hf(hf_config) if cls.FAMILY is None else cls.FAMILY.read(hf_config, cls.CONFIG)

    @classmethod
    def decoder_layer(cls, cfg) -> type[DecoderLayer]:
        """The layer class for `cfg`: DECODER_LAYER (a family whose layers' kind its config says overrides it:
        Cohere2-MoE's norms)."""
        return cls.DECODER_LAYER

    @classmethod
    def rope_head_dim(cls, cfg) -> int:
        """The width the model's rotary tables cover: cfg.head_dim (latent attention's: models/deepseek_v3.py)."""
        return cfg.head_dim

    def __init__(self, hf_config: dict, plan, *, dtype: torch.dtype = torch.float32):
        cfg = self.parse_config(hf_config)
        super().__init__(cfg, plan, self.decoder_layer(cfg), n_routed=cfg.num_experts,
                         rope_head_dim=self.rope_head_dim(cfg), dtype=dtype)
