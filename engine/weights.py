"""Checkpoint names -> engine parameters: a table of patterns, a pure function, hard checks.

`remap(hf_name, layout)` is pure: it says which engine parameter a checkpoint
tensor goes to, and for stacked expert parameters which expert slot and which half
(gate or up rows of `gate_up_proj`). `build_state_dict` applies it to a checkpoint
for one model: every expected tensor is loaded exactly once; a missing, unexpected,
duplicated or wrongly shaped tensor is an error naming it. Tensors owned by other
ranks (layers of other pipeline stages, other ranks' experts) are skipped.

Tensor parallelism (`WeightLayout.tp_size` > 1): the tensors of `TP_SPLITS` are cut
along one dimension into tp_size equal parts and this rank reads part tp_rank (the
shape checked is the part's); every other tensor is read whole (replicated), and so are
the routed experts with `tp_split_experts` False (the a2a path: engine/moe.py).

A family whose checkpoints spell some tensors differently (Mixtral's
`block_sparse_moe.experts.{e}.w1`) gives a `CheckpointNames` table: those names are
read as the engine's spelling first, and a missing tensor is named as its checkpoint
would spell it.

Fused layout (DESIGN 5.3): with `num_fused_shared > 0`, `mlp.shared_expert(s).*`
goes to expert slot `n_routed` (a checkpoint that is already pre-fused, holding
`mlp.experts.{n_routed}.*`, is accepted too: one or the other, not both). Unfused,
an expert index >= n_routed means the checkpoint is in the fused layout: refused.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

log = logging.getLogger(__name__)


class WeightError(ValueError):
    """A checkpoint that does not fit the model the plan built."""


class MissingTensor(WeightError):
    pass


class UnexpectedTensor(WeightError):
    pass


class DuplicateTensor(WeightError):
    pass


class ShapeMismatch(WeightError):
    pass


class LayoutMismatch(WeightError):
    """Fused-layout weights for an unfused model, or the reverse."""


def refuse_unless(error: type[Exception], ok: bool, field: str, value: Any, expected: str) -> None:
    """A quantization reader's refusal (awq.py, gptq.py, compressed_tensors.py): `error` naming
    config.quantization_config.<field> and its `value`, unless `ok`."""
    if not ok:
        raise error(f"config.quantization_config.{field}: {value!r} not supported; {expected}")


class CheckpointNames:
    """A family's checkpoint spellings <-> the engine's, as `(checkpoint, engine)` suffix templates
    (`"block_sparse_moe.experts.{e}.w1.weight"`, `"mlp.experts.{e}.gate_proj.weight"`): a name that
    ends with one template, after a dot, is the other with the same head and the same `{e}`. Pure."""

    def __init__(self, pairs: tuple[tuple[str, str], ...]):
        self.pairs = pairs
        self._to_engine = [(self._pattern(ckpt), engine) for ckpt, engine in pairs]
        self._to_checkpoint = [(self._pattern(engine), ckpt) for ckpt, engine in pairs]

    @staticmethod
    def _pattern(template: str) -> re.Pattern:
        body = re.escape(template).replace(re.escape("{e}"), r"(?P<e>\d+)")
        return re.compile(rf"^(?P<head>(?:.*\.)?){body}$")

    @staticmethod
    def _apply(table: list[tuple[re.Pattern, str]], name: str) -> str:
        for pattern, other in table:
            m = pattern.match(name)
            if m:
                return m["head"] + (other.replace("{e}", m["e"]) if "{e}" in other else other)
        return name

    def to_engine(self, name: str) -> str:
        return self._apply(self._to_engine, name)

    def to_checkpoint(self, name: str) -> str:
        return self._apply(self._to_checkpoint, name)

    def __eq__(self, other) -> bool:
        return isinstance(other, CheckpointNames) and other.pairs == self.pairs

    def __hash__(self) -> int:
        return hash(self.pairs)

    def __repr__(self) -> str:
        return f"CheckpointNames({self.pairs!r})"


@dataclass(frozen=True)
class WeightLayout:
    """What the remapping needs to know about the model the plan built (one runner)."""

    n_routed: int                               # global routed experts per MoE layer
    num_fused_shared: int = 0                   # plan: moe.num_fused_shared_experts
    local_experts: tuple[int, int] | None = None  # [start, end) of this rank's PHYSICAL routed slots; None = all
    num_physical: int | None = None             # plan: eplb.num_physical_experts; slot p holds expert
                                                # p % n_routed at load (EPLB replicas); None = n_routed
    layer_range: tuple[int, int] | None = None    # plan: pp.layer_range; None = all
    # Layers the model has at all (every stage's): a tensor of a layer beyond them is a checkpoint of another
    # model, unexpected, not another stage's to skip. None: not checked.
    n_layers: int | None = None
    has_embed: bool = True                      # first pipeline stage
    has_head: bool = True                       # last pipeline stage (final norm + lm_head)
    lm_head_from_embed: bool = False            # tied embeddings on a stage without the embedding
    ignore_prefixes: tuple[str, ...] = ()       # e.g. a wrapper's vision tower: skipped, counted, logged
    # (name, source): a tensor the checkpoint holds as `name`, or else shares with `source` (then `source` is
    # read as `name`). E.g. a Multi-Token-Prediction layer's embedding, which some exports keep only once.
    shared_from: tuple[tuple[str, str], ...] = ()
    tp_size: int = 1                            # plan: parallel.tp_size / tp_rank (TP_SPLITS)
    tp_rank: int = 0
    tp_split_experts: bool = True               # False: routed experts whole on every TP rank (the a2a path)
    names: CheckpointNames | None = None        # the family's own spellings (None: the engine's)
    gated_experts: bool = True                  # False: an expert's first projection is up_proj alone (relu^2)


@dataclass(frozen=True)
class Target:
    param: str                 # engine parameter name
    expert: int | None = None  # global id in a stacked expert parameter (>= n_routed: a fused shared slot)
    part: str | None = None    # "gate" / "up": which rows of a gate_up_proj; None: the whole slot


_MLP = r"(?P<mlp>.+\.mlp)"


def _expert_target(kind: str, tensor: str = "proj"):
    """`tensor` "proj": the expert's weight, into gate_up_proj / down_proj; "bias": its bias (gpt-oss), into
    gate_up_bias / down_bias."""
    def make(m: re.Match, lay: WeightLayout) -> Target:
        e = int(m["e"])
        if e >= lay.n_routed and lay.num_fused_shared == 0:
            raise LayoutMismatch(
                f"{m.string}: expert {e} >= n_routed_experts={lay.n_routed} means a checkpoint in the fused "
                f"layout (shared expert pre-fused as a routed slot), but the plan built an unfused model")
        if kind == "down":
            return Target(f"{m['mlp']}.experts.down_{tensor}", e)
        if not lay.gated_experts:   # up_proj fills the whole first projection; there is no gate to fill
            if m["part"] == "gate":
                raise UnexpectedTensor(f"unexpected tensor {m.string!r}: this model's experts have no gate "
                                       f"projection (up_proj and down_proj only)")
            return Target(f"{m['mlp']}.experts.gate_up_{tensor}", e)
        return Target(f"{m['mlp']}.experts.gate_up_{tensor}", e, m["part"])
    return make


def _shared_target(m: re.Match, lay: WeightLayout) -> Target:
    if lay.num_fused_shared == 0:
        return Target(m.string)
    part = m["part"]
    if part == "down":
        return Target(f"{m['mlp']}.experts.down_proj", lay.n_routed)
    return Target(f"{m['mlp']}.experts.gate_up_proj", lay.n_routed, part)


def _embed_target(m: re.Match, lay: WeightLayout) -> Target:
    # A wrapper keeps the text model under a prefix ("language_model."): its tied head is there too.
    return Target(f"{m['prefix']}lm_head.weight") if lay.lm_head_from_embed else Target(m.string)


# First match wins; anything unmatched keeps its name.
RULES: list[tuple[re.Pattern, Callable[[re.Match, WeightLayout], Target]]] = [
    (re.compile(rf"^{_MLP}\.experts\.(?P<e>\d+)\.(?P<part>gate|up)_proj\.weight$"), _expert_target("gate_up")),
    (re.compile(rf"^{_MLP}\.experts\.(?P<e>\d+)\.down_proj\.weight$"), _expert_target("down")),
    (re.compile(rf"^{_MLP}\.experts\.(?P<e>\d+)\.(?P<part>gate|up)_proj\.bias$"), _expert_target("gate_up", "bias")),
    (re.compile(rf"^{_MLP}\.experts\.(?P<e>\d+)\.down_proj\.bias$"), _expert_target("down", "bias")),
    (re.compile(rf"^{_MLP}\.shared_experts?\.(?P<part>gate|up|down)_proj\.weight$"), _shared_target),
    (re.compile(r"^(?P<prefix>(?:[A-Za-z_]\w*\.)*?)model\.embed_tokens\.weight$"), _embed_target),
]

# Tensor parallelism: (engine parameter, the dimension of the checkpoint tensor split over the TP ranks).
# Megatron-style, as the layers split themselves (engine/parallel/tensor.py): the projections into
# attention heads and into MLP / expert intermediate features by output rows, the projections out of
# them by input columns. A stacked expert parameter is filled per expert: its checkpoint tensors are
# gate_proj / up_proj [I, D] (rows split) and down_proj [D, I] (columns split). First match wins.
TP_SPLITS: list[tuple[re.Pattern, int]] = [
    (re.compile(r"\.self_attn\.[qkv]_proj\.(weight|bias)$"), 0),
    (re.compile(r"\.self_attn\.(q_b|kv_b)_proj\.weight$"), 0),      # MLA: latent -> heads (the latent stays whole)
    (re.compile(r"\.self_attn\.o_proj\.weight$"), 1),
    (re.compile(r"\.self_attn\.[qk]_proj_norm\.weight$"), 0),     # OLMoE: a norm over the whole projection
    (re.compile(r"\.self_attn\.sinks$"), 0),                     # gpt-oss: one sink logit per head
    (re.compile(r"\.self_attn\.gate_proj\.weight$"), 0),          # AFMoE: its output gate's rows, by head
    # MiniMax's lightning attention: each head's q, k, v rows together, its output gate's and its norm's features
    (re.compile(r"\.self_attn\.(qkv_proj|output_gate)\.weight$"), 0),
    (re.compile(r"\.self_attn\.norm\.weight$"), 0),
    (re.compile(r"\.self_attn\.out_proj\.weight$"), 1),
    # Gated DeltaNet (layers/gated_delta_net.py): by key head (each one's rows of q, k, v, z and b, a are
    # contiguous), the conv's channels and in_proj_qkv's rows as models/qwen3_next.py's checkpoint view
    # regroups them, by value head.
    (re.compile(r"\.linear_attn\.(in_proj_qkvz|in_proj_ba|in_proj_qkv|in_proj_[zba]|conv1d)\.weight$"), 0),
    (re.compile(r"\.linear_attn\.(A_log|dt_bias)$"), 0),
    (re.compile(r"\.linear_attn\.out_proj\.weight$"), 1),
    # Kimi Delta Attention (layers/kimi_delta_attention.py): by head. (Its q/k/v_proj and o_proj: the attention
    # entries above.) The Ling MLA's output gate (layers/mla.py): a row per head.
    (re.compile(r"\.self_attn\.([qkv]_conv1d|f_b_proj|g_b_proj|b_proj|f_proj|g_proj)\.weight$"), 0),
    (re.compile(r"\.self_attn\.(dt_bias|A_log)$"), 0),
    # LongCat-Flash: two MLA sublayers and two dense MLPs a layer, numbered
    (re.compile(r"\.self_attn\.\d+\.(q_b|kv_b)_proj\.weight$"), 0),
    (re.compile(r"\.self_attn\.\d+\.o_proj\.weight$"), 1),
    (re.compile(r"\.mlps\.\d+\.(gate|up)_proj\.weight$"), 0),
    (re.compile(r"\.mlps\.\d+\.down_proj\.weight$"), 1),
    # Mamba2 (layers/mamba2.py): by head, in_proj's rows and the conv's channels as its `rows_by_rank` regroups them.
    (re.compile(r"\.mamba\.(in_proj|conv1d)\.(weight|bias)$"), 0),
    (re.compile(r"\.mamba\.(dt_bias|A_log|D|norm\.weight)$"), 0),
    (re.compile(r"\.mamba\.out_proj\.weight$"), 1),
    # Mamba (layers/mamba1.py): x_proj reads every channel (its partial products all-reduced), dt_proj writes them.
    (re.compile(r"\.mamba\.x_proj\.weight$"), 1),
    (re.compile(r"\.mamba\.dt_proj\.(weight|bias)$"), 0),
    (re.compile(r"\.mlp\.(gate|up)_proj\.weight$"), 0),
    (re.compile(r"\.mlp\.up_proj\.bias$"), 0),                  # Nemotron-H's relu^2 MLP with mlp_bias
    (re.compile(r"\.mlp\.down_proj\.weight$"), 1),
    (re.compile(r"\.mlp\.experts\.gate_up_proj$"), 0),
    (re.compile(r"\.mlp\.experts\.gate_up_bias$"), 0),        # gpt-oss; its down_bias is whole (added once)
    (re.compile(r"\.mlp\.experts\.down_proj$"), 1),
]


def tp_split_dim(param: str, layout: WeightLayout) -> int | None:
    """The dimension along which `param`'s checkpoint tensors are split over the TP ranks; None:
    read whole (replicated, or no tensor parallelism). Pure."""
    if layout.tp_size == 1 or (not layout.tp_split_experts and _STACKED.search(param)):
        return None
    return next((dim for pattern, dim in TP_SPLITS if pattern.search(param)), None)


_LAYER_ID = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_STACKED = re.compile(r"\.experts\.(gate_up_proj|down_proj|gate_up_bias|down_bias)$")


def remap(name: str, layout: WeightLayout) -> Target:
    """The engine parameter (and expert slot / half) of checkpoint tensor `name`. Pure."""
    if layout.names is not None:
        name = layout.names.to_engine(name)
    for pattern, make in RULES:
        m = pattern.match(name)
        if m:
            return make(m, layout)
    return Target(name)


# The last stage's tensors outside the layers, by how their names end (a wrapper's `language_model.norm.weight`
# too): the final norm and the head, with their biases (Phi-3.5-MoE's).
_HEAD = re.compile(r"(lm_head|model\.norm)\.(weight|bias)$")


def is_local(target: Target, layout: WeightLayout) -> bool:
    """Does this runner hold the target? (Other stages' layers and other ranks' experts: no.)"""
    m = _LAYER_ID.search(target.param)
    if m and layout.layer_range is not None:
        lo, hi = layout.layer_range
        if not lo <= int(m.group(1)) < hi:
            return False
    if target.param.endswith("embed_tokens.weight") and not layout.has_embed:
        return False
    if not m and _HEAD.search(target.param) and not layout.has_head:
        return False
    if target.expert is not None and target.expert < layout.n_routed:
        return bool(_slots(target.expert, layout))
    return True


def _physical_range(layout: WeightLayout) -> tuple[int, int]:
    return layout.local_experts or (0, layout.num_physical or layout.n_routed)


def _slots(expert: int, layout: WeightLayout) -> list[int]:
    """Global expert id -> its indices in the local stacked parameter: the local physical slots
    holding it (slot p holds expert p % n_routed; several with EPLB replicas), or the fused slot
    (fused slots follow the local experts)."""
    lo, hi = _physical_range(layout)
    if expert >= layout.n_routed:
        return [(hi - lo) + expert - layout.n_routed]
    first = lo + (expert - lo) % layout.n_routed          # the first physical slot >= lo holding it
    return [p - lo for p in range(first, hi, layout.n_routed)]


def _global_id(slot: int, layout: WeightLayout) -> int:
    lo, hi = _physical_range(layout)
    return (lo + slot) % layout.n_routed if slot < hi - lo else layout.n_routed + slot - (hi - lo)


def _checkpoint_name(param: str, expert: int | None, part: str | None, layout: WeightLayout) -> str:
    """The checkpoint name(s) a missing target would have had, for error messages."""
    name = _engine_spelling(param, expert, part, layout)
    return name if layout.names is None else layout.names.to_checkpoint(name)


def _engine_spelling(param: str, expert: int | None, part: str | None, layout: WeightLayout) -> str:
    if expert is None:
        if param.endswith("lm_head.weight") and layout.lm_head_from_embed:
            return param[: -len("lm_head.weight")] + "model.embed_tokens.weight"
        return param
    mlp = param.rsplit(".experts.", 1)[0]
    proj = part or ("up" if ".experts.gate_up_" in param else "down")
    tensor = "bias" if param.endswith("_bias") else "weight"
    if expert < layout.n_routed:
        return f"{mlp}.experts.{expert}.{proj}_proj.{tensor}"
    return f"{mlp}.shared_expert(s).{proj}_proj.{tensor} (or pre-fused {mlp}.experts.{expert}.{proj}_proj.{tensor})"


@dataclass
class LoadReport:
    loaded: int = 0
    skipped_other_ranks: int = 0
    ignored: dict[str, int] = field(default_factory=dict)


def expected_targets(expected: Mapping[str, torch.Tensor],
                     layout: WeightLayout) -> set[tuple[str, int | None, str | None]]:
    """Every (param, expert, part) the checkpoint must fill for a model with these parameters."""
    need: set[tuple[str, int | None, str | None]] = set()
    for param, t in expected.items():
        m = _STACKED.search(param)
        if not m:
            need.add((param, None, None))
            continue
        parts = ("gate", "up") if m.group(1).startswith("gate_up") and layout.gated_experts else (None,)
        for slot in range(t.shape[0]):
            for part in parts:
                need.add((param, _global_id(slot, layout), part))
    return need


def build_state_dict(names: list[str], get: Callable[[str], torch.Tensor], shape_of: Callable[[str], tuple],
                     expected: Mapping[str, torch.Tensor], layout: WeightLayout, *,
                     device: torch.device | str = "cpu",
                     source_name: Callable[[str], str] | None = None) -> tuple[dict[str, torch.Tensor], LoadReport]:
    """Read the checkpoint tensors this runner holds into tensors shaped and typed like `expected`
    (a meta state dict of the built model). Raises a WeightError naming the first bad tensor, and, where the
    names are a view's (`source_name`: engine/shown_tensors.py), how the checkpoint itself spells it."""
    out: dict[str, torch.Tensor] = {}
    filled: dict[tuple[str, int | None, str | None], str] = {}
    report = LoadReport()
    held = set(names)
    aliases = {name: source for name, source in layout.shared_from if name not in held and source in held}
    if aliases:
        names = [*names, *aliases]
        get_, shape_of_ = get, shape_of
        get, shape_of = (lambda n: get_(aliases.get(n, n))), (lambda n: shape_of_(aliases.get(n, n)))
    for name in names:
        try:
            prefix = next((p for p in layout.ignore_prefixes if name.startswith(p)), None)
            if prefix is not None:
                report.ignored[prefix] = report.ignored.get(prefix, 0) + 1
                continue
            target = remap(name, layout)
            beyond = _LAYER_ID.search(target.param)
            if beyond and layout.n_layers is not None and int(beyond.group(1)) >= layout.n_layers:
                raise UnexpectedTensor(f"unexpected tensor {name!r}: layer {beyond.group(1)} is beyond the model's "
                                       f"{layout.n_layers} layers (num_hidden_layers, and any draft layers it stores "
                                       f"and skips by name)")
            if not is_local(target, layout):
                report.skipped_other_ranks += 1
                continue
            if target.param not in expected:
                raise UnexpectedTensor(f"unexpected tensor {name!r} in the checkpoint (engine parameter "
                                       f"{target.param!r} does not exist in this model)")
            key = (target.param, target.expert, target.part)
            if key in filled:
                raise DuplicateTensor(f"{name!r} and {filled[key]!r} both load into {target.param}"
                                      + (f" expert {target.expert}" if target.expert is not None else ""))
            meta = expected[target.param]
            if target.param not in out:
                out[target.param] = torch.empty(meta.shape, dtype=meta.dtype, device=device)
            views = [out[target.param]]
            if target.expert is not None:
                slots = _slots(target.expert, layout)
                if not all(0 <= s < views[0].shape[0] for s in slots):
                    raise UnexpectedTensor(f"unexpected tensor {name!r}: expert {target.expert} has no slot in "
                                           f"{target.param} ({views[0].shape[0]} slots)")
                views = [views[0][s] for s in slots]      # every local replica of the expert
                if target.part is not None:
                    half = views[0].shape[0] // 2
                    views = [v[:half] if target.part == "gate" else v[half:] for v in views]
            shape = tuple(shape_of(name))
            split = tp_split_dim(target.param, layout)
            if split is not None:
                if split >= len(shape) or shape[split] % layout.tp_size:
                    raise ShapeMismatch(f"tensor {name!r} of shape {list(shape)} does not split over tp_size="
                                        f"{layout.tp_size} along dimension {split}")
                shape = shape[:split] + (shape[split] // layout.tp_size,) + shape[split + 1:]
            if shape != tuple(views[0].shape):
                raise ShapeMismatch(f"tensor {name!r} has shape {list(shape)}, the model expects "
                                    f"{list(views[0].shape)} for {target.param}"
                                    + (f" expert {target.expert}" if target.expert is not None else ""))
            tensor = get(name)
            if split is not None:       # this rank's part of the whole tensor
                tensor = tensor.narrow(split, layout.tp_rank * shape[split], shape[split])
            for view in views:
                view.copy_(tensor)
            filled[key] = name
            report.loaded += 1
        except WeightError as e:
            if source_name is None or source_name(name) == name:
                raise
            raise type(e)(f"{e} [checkpoint tensor {source_name(name)!r}]") from None

    missing = expected_targets(expected, layout) - filled.keys()
    if missing:
        first = sorted(missing, key=lambda k: (k[0], -1 if k[1] is None else k[1], k[2] or ""))
        names_ = [_checkpoint_name(*k, layout) for k in first[:5]]
        raise MissingTensor(f"{len(missing)} tensor(s) missing from the checkpoint, e.g. {', '.join(names_)}")
    if report.ignored:   # one line for all skipped towers, however many prefixes
        log.info("skipped %d checkpoint tensors not part of the text model (%s)", sum(report.ignored.values()),
                 ", ".join(f"{p!r}: {n}" for p, n in sorted(report.ignored.items())))
    return out, report


def assign_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Assign (no copy) a complete state dict to a model built on meta; then nothing may remain on meta."""
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"{len(left)} tensor(s) still on meta after loading, e.g. {left[0]}")
    model.requires_grad_(False)
    model.eval()
