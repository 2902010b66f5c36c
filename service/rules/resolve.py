"""From one runner's request to its decisions (DESIGN sections 4-6). Pure.

`resolve_decisions` validates the request, follows the entry class to its
family, asks the family's gate, and derives every decision. Deployment-wide
decisions depend only on `deployment_inputs` (so ranks that agree on those get
identical decisions); rank-specific ones also depend on the rank.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, replace
from types import MappingProxyType
from typing import Any, Hashable, Mapping

from loadplan.config_view import ConfigView
from loadplan.errors import FailedPrecondition, InvalidArgument
from loadplan.layouts import MoeLayout
from loadplan.plan import ROLE_SPECULATIVE, ROLES, Decision, Keys, ResolveRequest
from ..lru import LruCache
from . import RULESET_VERSION, engine_inputs
from .backends import NORMAL, backend
from .devices import parse_device
from .engines import ENGINES, engine_of, with_engine
from .entries import Resolved, resolve_entry
from . import sglang, vllm
from .sglang_releases import release as sglang_release
from .gates import GateContext

_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}$")

# What the store can hold, checked here so a request it cannot hold is refused by name
# (INVALID_ARGUMENT) before anything is written, on every database:
MAX_INT32 = 2**31 - 1        # parallel sizes are INTEGER columns (and int32 on the wire)
MAX_NAME_LEN = 64            # a quantization name (a 128-character column)
MAX_JSON_DEPTH = 64          # configs are walked recursively (fingerprint, store)
MAX_INT_BITS = 14_000        # ~4300 digits, Python's int<->str limit: json cannot write more


@dataclass(frozen=True)
class Resolution:
    """`request` is the request as decided: its runtime names the engine and version that decided.
    `decisions` and `deployment_inputs` are read-only views that every resolve of the same
    deployment (and pipeline stage) shares, as `DEPLOYMENT_CACHE` keeps them: callers copy what
    they want to change, and the store and transport may encode them once, by identity."""

    entry_class: str
    chain: tuple[str, ...]
    family: str
    config_fingerprint: str
    quantization: str | None
    decisions: Mapping[str, Decision]
    deployment_inputs: Mapping[str, Any]
    request: ResolveRequest


def fingerprint(obj: Any) -> str:
    """sha256 of canonical JSON: key order and whitespace do not matter."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def validate_request(req: ResolveRequest, *, deployment_checked: bool = False) -> None:
    """Field-level checks that need no table look-up. `deployment_checked`: the fields of the
    deployment cache's key (quantization, sizes, runtime, configs) passed already, skip them;
    the rest run in the same order, so the first refusal is the same."""
    check_ids(req.request_id, req.deployment_id)
    if req.role not in ROLES:
        raise InvalidArgument("role", f"{req.role!r} is not a role; expected one of {', '.join(ROLES)}")
    if len(req.host) > 255:
        raise InvalidArgument("host", "longer than 255 characters")
    check_text("host", req.host)
    p = req.parallel
    if deployment_checked:
        for axis in ("tp", "ep", "pp", "dp"):
            size, rank = getattr(p, f"{axis}_size"), getattr(p, f"{axis}_rank")
            if not 0 <= rank < size:
                raise InvalidArgument(f"parallel.{axis}_rank", f"must be in [0, {axis}_size={size}), got {rank}")
        return
    if req.quantization is not None:
        check_name("quantization", req.quantization)
    for axis in ("tp", "ep", "pp", "dp"):
        size, rank = getattr(p, f"{axis}_size"), getattr(p, f"{axis}_rank")
        if size < 1:
            raise InvalidArgument(f"parallel.{axis}_size", f"must be >= 1, got {size}")
        if size > MAX_INT32:
            raise InvalidArgument(f"parallel.{axis}_size", f"must be <= {MAX_INT32}, got {size}")
        if not 0 <= rank < size:
            raise InvalidArgument(f"parallel.{axis}_rank", f"must be in [0, {axis}_size={size}), got {rank}")
    rt = req.runtime
    if rt.ep_num_redundant_experts < 0:
        raise InvalidArgument("runtime.ep_num_redundant_experts", f"must be >= 0, got {rt.ep_num_redundant_experts}")
    if rt.ep_num_redundant_experts > MAX_INT32:
        raise InvalidArgument("runtime.ep_num_redundant_experts",
                              f"must be <= {MAX_INT32}, got {rt.ep_num_redundant_experts}")
    if rt.ep_num_redundant_experts and not rt.enable_eplb:
        raise InvalidArgument("runtime.ep_num_redundant_experts", "redundant experts need runtime.enable_eplb")
    engine_inputs.check_shape(req)
    if rt.upgrade_from and (len(rt.upgrade_from) > 64 or not rt.upgrade_from.isprintable()
                            or rt.upgrade_from == rt.engine_version):
        raise InvalidArgument("runtime.upgrade_from", f"{rt.upgrade_from[:64]!r}: the release upgraded from, "
                                                      f"another than runtime.engine_version")
    engine_inputs.values(req, engine_of(req, parse_device(rt.device)).name)
    if req.quantization_config is not None and not isinstance(req.quantization_config, dict):
        raise InvalidArgument("quantization_config", "must be a JSON object")
    check_json_document("config", req.config)
    if req.quantization_config is not None:
        check_json_document("quantization_config", req.quantization_config)


def check_ids(request_id: str, deployment_id: str) -> None:
    """A request's two ids, checked first (`validate_request`), each by its field's name."""
    for name, value in (("request_id", request_id), ("deployment_id", deployment_id)):
        if not value:
            raise InvalidArgument(name, "required")
        if not _ID_RE.fullmatch(value):  # fullmatch: '$' alone would accept a trailing newline
            raise InvalidArgument(name, f"{value[:64]!r} must be 1-128 characters of letters, digits and ._:@/- "
                                        f"starting with a letter or digit")


def check_text(field: str, value: str) -> None:
    """Text the databases can store: no NUL (PostgreSQL text refuses it) and no unpaired
    surrogate (not Unicode: no UTF-8 encoding exists)."""
    if "\x00" in value:
        raise InvalidArgument(field, "contains a NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgument(field, f"contains an unpaired surrogate {value[e.start]!r} (not Unicode text)") \
            from None


def check_name(field: str, value: str) -> None:
    if len(value) > MAX_NAME_LEN:
        raise InvalidArgument(field, f"longer than {MAX_NAME_LEN} characters")
    check_text(field, value)
    if not value.isprintable():
        raise InvalidArgument(field, f"{value!r} contains control characters")


def check_json_document(field: str, doc: Any) -> None:
    """A config the registry can fingerprint and store: JSON types only, string keys,
    nesting <= MAX_JSON_DEPTH, text without unpaired surrogates, integers json can write.
    (NUL inside config strings is fine: JSON writes it as \\u0000.) Iterative, so a
    pathologically deep document cannot exhaust the stack."""
    stack: list[tuple[Any, str, int]] = [(doc, field, 1)]
    while stack:
        node, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise InvalidArgument(field, f"nested deeper than {MAX_JSON_DEPTH} levels (at {path})")
        if isinstance(node, str):
            _check_json_text(path, node)
        elif isinstance(node, bool) or node is None or isinstance(node, float):
            pass   # NaN and Infinity included: json reads and writes them, the fingerprint too
        elif isinstance(node, int):
            if node.bit_length() > MAX_INT_BITS:
                raise InvalidArgument(path, "integer too large (more than ~4300 digits)")
        elif isinstance(node, Mapping):
            for k, v in node.items():
                if not isinstance(k, str):
                    raise InvalidArgument(path, f"keys must be strings, got {type(k).__name__}")
                _check_json_text(f"{path}.<key>", k)
                stack.append((v, f"{path[:160]}.{_printable(k[:40])}", depth + 1))   # paths stay short
        elif isinstance(node, (list, tuple)):
            stack.extend((v, f"{path[:160]}[{i}]", depth + 1) for i, v in enumerate(node))
        else:
            raise InvalidArgument(path, f"{type(node).__name__} is not a JSON value")


def _printable(key: str) -> str:
    # A key is part of the error's field path, which must be sendable text whatever the key.
    return key.encode("unicode_escape").decode("ascii")


def _check_json_text(path: str, value: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgument(path, f"contains an unpaired surrogate {value[e.start]!r} (not Unicode text)") \
            from None


# Not compared between ranks: the upgrade a runner names (diff_deployment_inputs reads it).
UPGRADE_FROM = "upgrade_from"
LAYOUT = "layout"


def layout_of(decisions: Mapping[str, Decision]) -> str:
    """The fingerprint of the deployment-wide decisions' values (what every rank builds), but the profile's name:
    under an upgrade the operator named, two releases may share a deployment exactly while this is equal."""
    return fingerprint({k: d.value for k, d in decisions.items()
                        if d.deployment_wide and k not in (Keys.ENGINE_PROFILE, Keys.ENGINE_INPUTS_NOT_READ)})


def deployment_inputs(req: ResolveRequest, resolved: Resolved, layout: str = "") -> dict[str, Any]:
    """What every rank of one deployment and role must share (DESIGN 6); `layout`: `layout_of` its decisions."""
    p, rt = req.parallel, req.runtime
    return {
        "ruleset_version": RULESET_VERSION,
        "entry_class": resolved.chain[0],
        "config_fingerprint": fingerprint(dict(req.config)),
        "quantization": resolved.quantization.name,
        "quantization_config_fingerprint": fingerprint(req.quantization_config or {}),
        "parallel.tp_size": p.tp_size,
        "parallel.ep_size": p.ep_size,
        "parallel.pp_size": p.pp_size,
        "parallel.dp_size": p.dp_size,
        **{f"runtime.{k}": v for k, v in asdict(rt).items() if k != UPGRADE_FROM},
        UPGRADE_FROM: rt.upgrade_from,
        LAYOUT: layout,
    }


def diff_deployment_inputs(pinned: dict[str, Any], mine: dict[str, Any]) -> list[str]:
    """Names of the deployment-wide inputs where `mine` differs from the pinned ones. Two releases differ only where
    no upgrade was named: under an upgrade the operator named (one side's upgrade_from is the other's release),
    they may differ while the layout (every deployment-wide decision) is the same; a changed layout is named."""
    # The layout follows from the other inputs: compared only where a named upgrade lets the release differ.
    differing = sorted(k for k in pinned.keys() | mine.keys()
                       if pinned.get(k) != mine.get(k) and k not in (UPGRADE_FROM, LAYOUT))
    version = "runtime.engine_version"
    named = mine.get(UPGRADE_FROM) and mine.get(UPGRADE_FROM) == pinned.get(version) or \
        pinned.get(UPGRADE_FROM) and pinned.get(UPGRADE_FROM) == mine.get(version)
    if named and version in differing and pinned.get(LAYOUT) == mine.get(LAYOUT):
        differing.remove(version)     # the same layout on both releases
    elif named and version in differing:
        differing.append(LAYOUT)      # the layout changes with the release: say both
    return differing


def resolve_decisions(req: ResolveRequest, inputs_key: Hashable | None = None) -> Resolution:
    """The decisions for `req`, validated.

    `inputs_key`, when given, must determine `req.config` and `req.quantization_config`
    exactly (the transport passes the raw JSON texts they were parsed from): the
    deployment-wide part (config parsing, gating, fingerprints, most decisions) is then
    computed once per (texts, quantization, runtime, sizes) and kept in a bounded LRU, and
    each call adds only its own rank's decisions. Same answer as without the key: both
    paths run `_deployment_part` and `_Part.for_rank`, the cache only skips recomputing the
    first (and the checks of fields in its key, which passed when it was computed;
    refusals are never cached)."""
    if inputs_key is None:
        validate_request(req)
        return _deployment_part(_decided(req)).for_rank(req)
    p = req.parallel
    key = (inputs_key, req.quantization, req.runtime, p.tp_size, p.ep_size, p.pp_size, p.dp_size)
    try:
        part = DEPLOYMENT_CACHE.get(key)
    except TypeError:   # something unhashable in the request: no caching for it
        return resolve_decisions(req)
    if part is None:
        validate_request(req)
        part = _deployment_part(_decided(req))
        DEPLOYMENT_CACHE.put(key, part)
    else:
        validate_request(req, deployment_checked=True)
    return part.for_rank(req)


def _decided(req: ResolveRequest) -> ResolveRequest:
    """A validated `req` with the engine that decides it (the named one or its device's default)."""
    return with_engine(req, engine_of(req, parse_device(req.runtime.device)))


class _Part:
    """What every rank of one deployment gets (a `Resolution` without the rank's decisions)."""

    __slots__ = ("tiling", "entry_class", "chain", "family", "config_fingerprint", "quantization", "head", "eplb_head",
                 "n_layers", "first_layer", "moe_layers", "enable_eplb", "inputs", "stages", "runtime")

    def for_rank(self, req: ResolveRequest) -> Resolution:
        """`req`'s resolution; its runtime is the part's (the same request's but for the engine that
        decided: `runtime` is in the cache key), so the engine is settled once per part."""
        # pp_size is the part's (it is in the cache key), so the stage alone settles the
        # rank's decisions: made once per stage, shared like the deployment-wide ones (and so,
        # like them, never changed by anyone, their list values included). Both are handed out
        # as read-only views, the same objects for every rank of the stage: no copy per resolve,
        # and what encodes them (the store's rows, the answer's bytes) can do it once per view.
        d = self.stages.get(req.parallel.pp_rank)
        if d is None:
            d = self.stages[req.parallel.pp_rank] = MappingProxyType(self._stage_decisions(req.parallel))
        return Resolution(self.entry_class, self.chain, self.family, self.config_fingerprint, self.quantization,
                          d, self.inputs, req if req.runtime is self.runtime else replace(req, runtime=self.runtime))

    def _stage_decisions(self, p) -> dict[str, Decision]:
        start, end = self.tiling(self.n_layers, p.pp_size, p.pp_rank)
        layer_range = [self.first_layer + start, self.first_layer + end]
        d = dict(self.head)
        d[Keys.PP_LAYER_RANGE] = Decision(
            Keys.PP_LAYER_RANGE, layer_range,
            f"stage {p.pp_rank} of {p.pp_size} owns layers [{layer_range[0]}, {layer_range[1]})", "pp.tiling",
            False)
        d.update(self.eplb_head)
        if self.enable_eplb:
            local_moe = [i for i in self.moe_layers if layer_range[0] <= i < layer_range[1]]
            d[Keys.EPLB_LAYERS] = Decision(
                Keys.EPLB_LAYERS, local_moe,
                f"the MoE layers of stage {p.pp_rank} (global ids); fused shared slots are not movable",
                "eplb.local_layers", False)
        else:
            d[Keys.EPLB_LAYERS] = Decision(Keys.EPLB_LAYERS, [], "EPLB not enabled", "eplb.local_layers", False)
        return d


# Distinct deployment-wide inputs remembered per process: a fleet has a handful of configs.
DEPLOYMENT_CACHE_SIZE = 256
DEPLOYMENT_CACHE = LruCache(DEPLOYMENT_CACHE_SIZE)


def _deployment_part(req: ResolveRequest) -> _Part:
    """Everything but the rank's own decisions. Reads the rank only through the gate context,
    whose gates are deployment-wide by contract (tests/service/rules: ranks agree)."""
    cfg = ConfigView(req.config)
    entry_class = cfg.architecture()
    resolved = resolve_entry(entry_class, cfg, req.quantization, req.quantization_config)
    if resolved.quantization.name is not None:
        # From the request or from the config's quant_method: stored either way.
        check_name("quantization" if req.quantization else "quantization_config.quant_method",
                   resolved.quantization.name)
    if req.runtime.engine == sglang.NAME:
        sglang.check_draft(resolved.family.name, resolved.cfg, sglang_release(req.runtime.engine_version))
    layout = resolved.family.layout(resolved.cfg)
    if req.runtime.engine == sglang.NAME:
        sglang.check_layout(resolved.family.name, resolved.cfg, layout)
    device = parse_device(req.runtime.device)
    p, rt = req.parallel, req.runtime
    if rt.engine == sglang.NAME:
        return _sglang_part(req, resolved, layout, device)
    if rt.engine == vllm.NAME:
        return _vllm_part(req, resolved, layout, device)
    row = backend(req.runtime.a2a_backend)

    d: dict[str, Decision] = {}

    def put(key: str, value: Any, reason: str, rule: str, deployment_wide: bool = True) -> None:
        d[key] = Decision(key, value, reason, rule, deployment_wide)

    engine = ENGINES[rt.engine]
    profile = engine.profile(rt.engine_version)
    put(Keys.ENGINE_PROFILE, profile, f"the {profile} profile decides: {engine.summary}",
        f"engine.{engine.name}")
    d.update(_not_read(req))
    put(Keys.ENTRY_FAMILY, resolved.family.name,
        f"{' -> '.join(resolved.chain)} builds the {resolved.family.name} family", "entries.table")

    # --- shared-experts fusion (DESIGN 5.2) ---------------------------------
    fused, rule, reason = _fusion(req, resolved, layout, row, device, engine.runner)
    put(Keys.SHARED_EXPERTS_FUSION, fused, reason, rule)
    n_fused = layout.n_shared if fused else 0
    put(Keys.NUM_FUSED_SHARED_EXPERTS, n_fused,
        f"{n_fused} shared expert slot(s) appended after the {layout.n_routed} routed experts" if fused
        else "not fused", rule)

    # --- forward path and reduction (DESIGN 5.1, 5.4) -----------------------
    put(Keys.FORWARD_PATH, row.forward_path,
        f"a2a backend {row.name} runs the {row.forward_path} path", f"backend.{row.name}.path")
    split = p.ep_size * p.tp_size > 1
    if row.combine_reduces:
        reduce, why = False, f"backend {row.name}'s combine already sums the expert outputs"
    elif not split:
        reduce, why = False, "experts are not split across ranks (ep_size * tp_size == 1)"
    else:
        reduce, why = True, (f"{row.forward_path} path with experts split over ep_size={p.ep_size}, "
                             f"tp_size={p.tp_size}: each rank holds partial sums")
    put(Keys.POST_EXPERTS_ALL_REDUCE, reduce, why, f"backend.{row.name}.reduction")

    if fused and row.forward_path == NORMAL and p.ep_size > 1:
        put(Keys.FUSED_SHARED_EXPERT_SCALE, 1.0 / p.ep_size,
            f"a global fused slot on every one of ep_size={p.ep_size} ranks: the all-reduce must sum it once",
            "reduction.fused_scale")
    else:
        put(Keys.FUSED_SHARED_EXPERT_SCALE, 1.0,
            "not fused" if not fused else "the fused slot is computed once per token", "reduction.fused_scale")

    # --- expert sharding ---------------------------------------------------
    physical = layout.n_routed + (rt.ep_num_redundant_experts if rt.enable_eplb else 0)
    if physical % p.ep_size:
        raise FailedPrecondition(
            f"parallel.ep_size: {physical} physical experts ({layout.n_routed} routed + "
            f"{physical - layout.n_routed} redundant) do not divide over ep_size={p.ep_size}")
    put(Keys.NUM_LOCAL_EXPERTS, physical // p.ep_size,
        f"{physical} physical experts over ep_size={p.ep_size}", "sharding.experts")

    return _finish(req, resolved, layout, d, physical, stage_range, eplb=rt.enable_eplb,
                   eplb_off_reason="EPLB not enabled (runtime.enable_eplb is false)")


def _finish(req: ResolveRequest, resolved: Resolved, layout: MoeLayout, head: dict[str, Decision], physical: int,
            tiling, *, eplb: bool, eplb_off_reason: str) -> "_Part":
    """The pipeline stage (DESIGN 5.5) and EPLB parts, and the part's identity: the rank's part is made in
    `_Part.for_rank` with the profile's `tiling`."""
    rt = req.runtime
    d: dict[str, Decision] = {}

    def put(key: str, value: Any, reason: str, rule: str, deployment_wide: bool = True) -> None:
        d[key] = Decision(key, value, reason, rule, deployment_wide)

    part = _Part()
    part.tiling = tiling
    part.stages = {}
    part.head = head
    if eplb:
        put(Keys.EPLB_ENABLED, True, "enable_eplb requested", "eplb.intent")
        put(Keys.EPLB_NUM_PHYSICAL_EXPERTS, physical,
            f"{layout.n_routed} routed + {rt.ep_num_redundant_experts} redundant", "eplb.physical")
    else:
        put(Keys.EPLB_ENABLED, False, eplb_off_reason, "eplb.intent")
        put(Keys.EPLB_NUM_PHYSICAL_EXPERTS, layout.n_routed, "EPLB not enabled: one copy of each expert",
            "eplb.physical")
    part.eplb_head = d
    part.enable_eplb = eplb
    part.n_layers = len(layout.layer_ids)
    part.first_layer = layout.layer_ids[0] if layout.layer_ids else 0
    part.moe_layers = tuple(layout.moe_layers)
    inputs = deployment_inputs(req, resolved, layout_of({**head, **d}))
    part.inputs = MappingProxyType(inputs)
    part.runtime = req.runtime    # as decided: names the engine and version
    part.entry_class = resolved.chain[0]
    part.chain = resolved.chain
    part.family = resolved.family.name
    part.config_fingerprint = inputs["config_fingerprint"]
    part.quantization = resolved.quantization.name
    return part


def _profile_head(req: ResolveRequest, resolved: Resolved) -> dict[str, Decision]:
    engine = ENGINES[req.runtime.engine]
    profile = engine.profile(req.runtime.engine_version)
    return {
        Keys.ENGINE_PROFILE: Decision(Keys.ENGINE_PROFILE, profile, f"the {profile} profile decides: {engine.summary}",
                                      f"engine.{engine.name}", True),
        Keys.ENTRY_FAMILY: Decision(Keys.ENTRY_FAMILY, resolved.family.name,
                                    f"{' -> '.join(resolved.chain)} builds the {resolved.family.name} family",
                                    "entries.table", True),
        **_not_read(req),
    }


def _not_read(req: ResolveRequest) -> dict[str, Decision]:
    """The engine inputs the request sent that its profile does not read: kept, and said so (none: no decision)."""
    not_read = engine_inputs.values(req, req.runtime.engine)[1]
    if not not_read:
        return {}
    return {Keys.ENGINE_INPUTS_NOT_READ: Decision(
        Keys.ENGINE_INPUTS_NOT_READ, not_read,
        f"the {req.runtime.engine} profile does not read these (kept in the request; they change no decision here)",
        "engine.inputs", True)}


def _embedded_qconfig(req: ResolveRequest) -> dict | None:
    """The quantization config the checkpoint declares (the request's, else the config's, else its text model's)."""
    if isinstance(req.quantization_config, dict):
        return req.quantization_config
    for doc in (req.config, req.config.get("text_config") if isinstance(req.config, Mapping) else None):
        if isinstance(doc, Mapping) and isinstance(doc.get("quantization_config"), dict):
            return doc["quantization_config"]
    return None


def _shared_decisions(put, fused: bool, rule: str, reason: str, layout: MoeLayout, path: str, ep: int,
                      per_rank_slots: bool) -> None:
    put(Keys.SHARED_EXPERTS_FUSION, fused, reason, rule)
    n_fused = layout.n_shared if fused else 0
    put(Keys.NUM_FUSED_SHARED_EXPERTS, n_fused,
        f"{n_fused} shared expert slot(s) appended after the {layout.n_routed} routed experts" if fused
        else "not fused", rule)
    if fused and path == NORMAL and ep > 1 and not per_rank_slots:
        put(Keys.FUSED_SHARED_EXPERT_SCALE, 1.0 / ep,
            f"a global fused slot on every one of ep_size={ep} ranks: the all-reduce must sum it once",
            "reduction.fused_scale")
    else:
        put(Keys.FUSED_SHARED_EXPERT_SCALE, 1.0,
            "not fused" if not fused else "the fused slot is computed once per token", "reduction.fused_scale")


def _sharding(put, layout: MoeLayout, rt, ep: int) -> int:
    physical = layout.n_routed + (rt.ep_num_redundant_experts if rt.enable_eplb else 0)
    if physical % ep:
        raise FailedPrecondition(
            f"parallel.ep_size: {physical} physical experts ({layout.n_routed} routed + "
            f"{physical - layout.n_routed} redundant) do not divide over ep_size={ep}")
    put(Keys.NUM_LOCAL_EXPERTS, physical // ep, f"{physical} physical experts over ep_size={ep}", "sharding.experts")
    return physical


def _sglang_part(req: ResolveRequest, resolved: Resolved, layout: MoeLayout, device) -> "_Part":
    """The sglang profile (service/rules/sglang.py) of the request's release: SGLang's resolution, gates, forward and
    tiling."""
    p, rt = req.parallel, req.runtime
    archs = resolved.cfg.raw("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else resolved.chain[-1]
    arch = sglang.WRAPPER_ARCHITECTURE.get(resolved.chain[0], arch)
    draft = req.role == ROLE_SPECULATIVE
    dec = sglang.decide(entry_class=resolved.chain[0], architecture=arch, layout=layout,
                        quantization=resolved.quantization, qconfig=_embedded_qconfig(req), device=device,
                        a2a=rt.a2a_backend, runner=rt.moe_runner_backend, tp=p.tp_size, ep=p.ep_size, dp=p.dp_size,
                        sbo=rt.enable_sbo, tbo=rt.enable_tbo, disable_fusion=rt.disable_shared_experts_fusion,
                        enforce_fusion=rt.enforce_shared_experts_fusion, draft=draft, config=req.config,
                        cfg=resolved.cfg, release=sglang_release(rt.engine_version),
                        use_aiter=engine_inputs.values(req, sglang.NAME)[0]["SGLANG_USE_AITER"])
    d = _profile_head(req, resolved)

    def put(key: str, value: Any, reason: str, rule: str, deployment_wide: bool = True) -> None:
        d[key] = Decision(key, value, reason, rule, deployment_wide)

    # The MoE runner SGLang's resolution leaves, on every plan (a rewrite below says why it changed).
    put(sglang.RUNNER_KEY, dec.inputs.runner, f"--moe-runner-backend {dec.inputs.runner}, as SGLang's server-args "
                                              f"resolution leaves it", "sglang.moe_runner_backend")
    for rw in dec.rewrites:   # what SGLang's server-args resolution rewrote, with its reason
        put(rw.key, rw.value, rw.reason, f"sglang.rewrite.{rw.key.split('.', 1)[1]}")
    fused, rule, reason = dec.fused
    shape = dec.inputs.shape
    _shared_decisions(put, fused, rule, reason, layout, dec.forward.path, shape.ep,
                      dec.inputs.a2a in sglang.PER_RANK_FUSED_SLOTS)
    put(Keys.FORWARD_PATH, dec.forward.path, dec.forward.reason, dec.forward.rule)
    put(Keys.POST_EXPERTS_ALL_REDUCE, dec.forward.all_reduce, dec.forward.reason, dec.forward.rule + ".reduction")
    # SGLang does not refuse experts that do not divide over its ep_size (the last rank holds fewer).
    physical = layout.n_routed + (rt.ep_num_redundant_experts if rt.enable_eplb else 0)
    put(Keys.NUM_LOCAL_EXPERTS, -(-physical // shape.ep),
        f"{physical} physical experts over SGLang's ep_size={shape.ep} (at most)", "sharding.experts")
    eplb = rt.enable_eplb and not draft
    return _finish(req, resolved, layout, d, physical, sglang.stage_range, eplb=eplb,
                   eplb_off_reason=("SGLang gives a draft worker no EPLB manager (model_runner: not "
                                    "is_draft_worker)" if rt.enable_eplb and draft
                                    else "EPLB not enabled (runtime.enable_eplb is false)"))


def _vllm_part(req: ResolveRequest, resolved: Resolved, layout: MoeLayout, device) -> "_Part":
    """The vllm profile (service/rules/vllm.py) of the request's release: vLLM's all2all kernels, reduction and
    fusion."""
    p, rt = req.parallel, req.runtime
    fwd = vllm.forward(rt.a2a_backend, p.tp_size, p.ep_size, p.dp_size, rt.engine_version or vllm.NEWEST)
    d = _profile_head(req, resolved)

    def put(key: str, value: Any, reason: str, rule: str, deployment_wide: bool = True) -> None:
        d[key] = Decision(key, value, reason, rule, deployment_wide)

    if rt.disable_shared_experts_fusion:
        fused = (False, "intent.disable_shared_experts_fusion", "disable_shared_experts_fusion requested")
    elif layout.n_shared == 0:
        fused = (False, f"{resolved.family.name}.no_shared_experts", "no shared experts")
    else:
        fused = (False, vllm.FUSION_RULE, vllm.FUSION_REASON)
    _shared_decisions(put, *fused, layout, fwd.path, p.ep_size, False)
    put(Keys.FORWARD_PATH, fwd.path, fwd.reason, fwd.rule)
    put(Keys.POST_EXPERTS_ALL_REDUCE, fwd.all_reduce, fwd.reason, fwd.rule + ".reduction")
    physical = _sharding(put, layout, rt, p.ep_size)
    return _finish(req, resolved, layout, d, physical, vllm.stage_range, eplb=rt.enable_eplb,
                   eplb_off_reason="EPLB not enabled (runtime.enable_eplb is false)")


def stage_range(n_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """[start, end) of stage pp_rank; stages tile all layers, earlier ones take the remainder."""
    if pp_size > n_layers:
        raise FailedPrecondition(f"parallel.pp_size: {pp_size} stages for {n_layers} layers leaves a stage empty")
    base, extra = divmod(n_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


def _fusion(req: ResolveRequest, resolved: Resolved, layout: MoeLayout, row, device,
            runner: str) -> tuple[bool, str, str]:
    rt = req.runtime
    if rt.disable_shared_experts_fusion:
        return False, "intent.disable_shared_experts_fusion", \
            "disable_shared_experts_fusion requested (the gate is not asked)"
    if layout.n_shared == 0 or not resolved.family.has_shared_experts:
        return False, f"{resolved.family.name}.no_shared_experts", "no shared experts"
    if row.fusion_force_disabled:
        return False, f"backend.{row.name}.fusion_force_disabled", \
            f"a2a backend {row.name} forces shared-experts fusion off"
    if row.forward_path != NORMAL and req.parallel.ep_size > 1 and not row.per_rank_fused_slots:
        return False, f"backend.{row.name}.no_per_rank_fused_slots", \
            f"a2a backend {row.name} cannot hold a fused shared slot on every rank under ep_size=" \
            f"{req.parallel.ep_size}"
    if resolved.family.never_fuses is not None:     # structural: enforce does not skip it
        verdict = resolved.family.never_fuses.verdict(layout)
        return False, verdict.rule, verdict.reason
    gate = resolved.family.gate
    assert gate is not None, f"family {resolved.family.name} has shared experts but no gate"
    ctx = GateContext(resolved.chain[-1], resolved.fused_architecture, resolved.cfg, layout,
                      resolved.quantization, rt, req.parallel, row, device, runner)
    verdict = gate(ctx)
    if verdict is not None:
        return False, verdict.rule, verdict.reason
    enforced = " (enforced: optional conditions skipped)" if rt.enforce_shared_experts_fusion else ""
    return True, f"{resolved.family.name}.fused", \
        f"{layout.n_shared} shared expert(s) run as routed slot {layout.n_routed}{enforced}"
