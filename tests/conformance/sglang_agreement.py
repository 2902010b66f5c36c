"""Does the registry's sglang profile agree with SGLang 0.5.23 on a grid point?

The recording (tests/data/sglang_0.5.23_grid.jsonl.gz, written by
scripts/record_sglang_grid.py) holds SGLang's own answer per point. `verdict` asks the
registry's rules in-process (`resolve_decisions`, runtime.engine = "sglang") the same
question, one request per pipeline stage, and says whether they agree:

- SGLang refuses to start (or its model file cannot run the branch) and the registry
  refuses: agree ("both refuse");
- the registry refuses with a message starting `hazard:` (DESIGN 8.3) and SGLang's answer shows what that hazard
  says its code runs (`HAZARD_SHOWS`: a reduction owed after an a2a combine, a fused slot on a dispatch path, a
  fused 384-expert layout), or SGLang refuses: agree ("hazard");
- both answer, the MoE runner the registry records SGLang's resolution picking is SGLang's, and
  `moe.shared_experts_fusion`, `moe.forward_path`,
  `moe.post_experts_all_reduce`, `pp.layer_range` per stage and `eplb.enabled` /
  `eplb.layers` equal SGLang's: agree;
- anything else: a disagreement, with what differs.

Grid point -> request: loadplan's tp × ep is SGLang's tp = tp·ep, ep = ep (DESIGN 8.1);
`dp` is SGLang's attention-DP width (`--dp-size dp --enable-dp-attention`), sent as
`parallel.dp_size`. A draft point is the speculative runner's request: its config is the
draft checkpoint's config with the architectures SGLang's ModelConfig gave it (a NextN
draft names the NextN class). A standalone draft (another checkpoint) runs on the server's MoE runner, which SGLang
resolves once for the target: its request names the runner the registry answered for the target's request, as the
SGLang adapter sends the server's resolved runner.

    .venv/bin/python -m tests.conformance.sglang_agreement [RELEASE ...]   # prints each release's agreement
"""

from __future__ import annotations

import collections
import gzip
import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from loadplan.plan import ENGINE_SGLANG, ROLE_SPECULATIVE, ROLE_TARGET, Keys, Parallel, ResolveRequest, Runtime
from loadplan.errors import RegistryError
from loadplan.service.rules.resolve import resolve_decisions
from loadplan.service.rules.sglang_releases import NEWEST, RELEASES

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RECORDINGS = ROOT / "tests" / "data"


def recording_of(release: str) -> Path:
    """The recorded grid of one SGLang release (scripts/record_sglang_grid.py --release)."""
    return RECORDINGS / f"sglang_{release}_grid.jsonl.gz"


RECORDING = recording_of(NEWEST.version)
CONFIG_DIRS = (ROOT / "tests" / "data" / "configs", HERE / "configs")
HAZARD_PREFIX = "hazard:"
RUNNER_KEY = "sglang.moe_runner_backend"
# What agreeing is, point by point: the decisions equal; both refuse, the registry in SGLang's own words for the first
# check SGLang fails; a hazard SGLang's own answer shows.
KIND_EQUAL = "decisions equal"
KIND_BOTH_REFUSE = "both refuse, in SGLang's words"
KIND_HAZARD = "hazard shown by SGLang's answer"
# What SGLang's own answer shows where a hazard's wrong layout is what its code runs (service/rules/hazards.py).
# A hazard not here is not visible in the answer (a NextN draft's missing MTP weights).
HAZARD_SHOWS = {
    "sglang.double_reduction": lambda a: a.get("forward_path") == "a2a" and a.get("post_experts_all_reduce") is True,
    "sglang.fused_global_slot_on_dispatch": lambda a: bool(a.get("shared_experts_fusion"))
    and a.get("forward_path") == "a2a",
    "sglang.enforced_384_without_quark": lambda a: bool(a.get("shared_experts_fusion")),
}


def load_recording(path: Path = RECORDING) -> tuple[dict, list[dict]]:
    """(header, records); each record is {"point": ..., "answer": ...}."""
    with gzip.open(path, "rt") as f:
        header = json.loads(f.readline())
        records = [json.loads(line) for line in f if line.strip()]
    return header, records


@lru_cache(maxsize=None)
def _config_text(name: str) -> str:
    for base in CONFIG_DIRS:
        path = base / name / "config.json"
        if path.is_file():
            return path.read_text()
    raise FileNotFoundError(f"config {name!r} not under {[str(b) for b in CONFIG_DIRS]}")


def point_name(point: dict) -> str:
    """A short, unique, readable name of a grid point (used in failures)."""
    keys = ("grid", "config", "draft_config", "device", "a2a_backend", "moe_runner_backend",
            "tp", "ep", "dp", "pp", "disable_fusion", "enforce_fusion", "sbo", "tbo", "eplb", "quantization")
    parts = []
    for k in keys:
        v = point.get(k)
        if v in (None, False) or (k == "pp" and v == 1) or (k == "dp" and v == 1):
            continue
        parts.append(k if v is True else f"{k}={v}")
    return " ".join(parts + [f"{k}={v}" for k, v in sorted(point.get("engine_env", {}).items())])


def oracle_args(point: dict) -> tuple[str, ...]:
    """The oracle process a point is answered in: its device and the environment switches set before SGLang's
    import (one process per distinct pair)."""
    return ("--device", point["device"], *(a for k, v in sorted(point.get("engine_env", {}).items())
                                           for a in ("--engine-env", f"{k}={v}")))


def server_runner(point: dict, release: str = "") -> str:
    """The MoE runner a standalone draft runs on: the server's, which SGLang resolves once for its target (the
    registry's own answer for the target's request; "" where the registry refuses the target)."""
    target = {k: v for k, v in point.items() if k != "draft_config"}
    try:
        runner = resolve_decisions(requests_for(target, {}, release)[0]).decisions.get(RUNNER_KEY)
    except RegistryError:
        return ""
    return runner.value if runner is not None else ""


def requests_for(point: dict, answer: dict, release: str = "") -> list[ResolveRequest]:
    """The registry requests of one grid point, decided by the profile of SGLang `release` ("" the newest): one per
    pipeline stage (rank 0 elsewhere)."""
    draft = point.get("draft_config")
    config = json.loads(_config_text(draft or point["config"]))
    if draft and answer.get("config_architectures"):
        config["architectures"] = answer["config_architectures"]
    quant_cfg = config.get("quantization_config")
    runner = point.get("moe_runner_backend") or ""
    if draft and draft != point["config"]:
        runner = server_runner(point, release)
    runtime = Runtime(
        a2a_backend=point.get("a2a_backend", "none"),
        device=point["device"],
        engine=ENGINE_SGLANG,
        engine_version=release,
        moe_runner_backend=runner,
        enable_sbo=bool(point.get("sbo")),
        enable_tbo=bool(point.get("tbo")),
        disable_shared_experts_fusion=bool(point.get("disable_fusion")),
        enforce_shared_experts_fusion=bool(point.get("enforce_fusion")),
        enable_eplb=bool(point.get("eplb")),
        engine_env=point.get("engine_env", {}),
    )
    pp = point.get("pp", 1)
    return [
        ResolveRequest(
            request_id=f"conformance-{i}",
            deployment_id="conformance",
            role=ROLE_SPECULATIVE if draft else ROLE_TARGET,
            parallel=Parallel(tp_size=point["tp"], ep_size=point["ep"], pp_size=pp, pp_rank=i,
                              dp_size=point.get("dp", 1)),
            config=config,
            quantization_config=quant_cfg if isinstance(quant_cfg, dict) else None,
            quantization=point.get("quantization"),
            runtime=runtime,
        )
        for i in range(pp)
    ]


@dataclass
class Verdict:
    agrees: bool
    kind: str                    # "both refuse", "hazard", "agree", or what differs
    differences: list[str] = field(default_factory=list)


def sglang_refuses(answer: dict) -> str | None:
    """SGLang's own words for why it does not run the point (its first failed check), or None when it runs it."""
    if answer.get("refused"):
        message = answer.get("message") or ""
        kind, _, words = message.partition(": ")
        return words if kind.isidentifier() and words else message
    branch = answer.get("branch") or ""
    if branch.startswith("not_implemented"):
        return f"NotImplementedError: {branch.split(': ', 1)[-1]}"
    return None


def _folded(text: str) -> str:
    return " ".join(text.split())


def carries(message: str, words: str) -> bool:
    """Does the registry's message carry SGLang's words (white space folded; the recording keeps a long message's
    first 600 characters, which the whole message then holds)?"""
    return _folded(words) in _folded(message)


def verdict(point: dict, answer: dict, release: str = "") -> Verdict:
    if "error" in answer:
        return Verdict(False, "oracle error", [answer["error"][-300:]])
    words = sglang_refuses(answer)
    plans, refusal, message = [], None, ""
    try:
        plans = [resolve_decisions(req) for req in requests_for(point, answer, release)]
    except RegistryError as e:
        refusal, message = f"{e.code}: {e.message}", e.message
    if refusal is not None:
        if message.startswith(HAZARD_PREFIX):
            hazard = message[len(HAZARD_PREFIX):].split(":", 1)[0].strip()
            shows = HAZARD_SHOWS.get(hazard)
            if words is not None:
                return Verdict(False, "registry calls a hazard what SGLang refuses",
                               [f"{refusal[:300]}; SGLang: {words[:300]}"])
            if shows is None:
                return Verdict(False, "hazard without a check of SGLang's answer", [refusal[:300]])
            if shows(answer):
                return Verdict(True, KIND_HAZARD)
            return Verdict(False, "registry claims a hazard SGLang's code does not run",
                           [f"{refusal[:300]}; SGLang: fusion {answer.get('shared_experts_fusion')}, forward "
                            f"{answer.get('forward_path')}, all-reduce {answer.get('post_experts_all_reduce')}"])
        if words is None:
            return Verdict(False, "registry refuses, SGLang runs it", [refusal[:300]])
        if carries(message, words):
            return Verdict(True, KIND_BOTH_REFUSE)
        return Verdict(False, "both refuse, for another reason", [f"registry {refusal[:300]} | SGLang {words[:300]}"])
    if words is not None:
        return Verdict(False, "SGLang refuses, registry answers", [f"SGLang {words[:300]}"])

    diffs = []

    def same(key, mine, sglang):
        if mine != sglang:
            diffs.append(f"{key}: registry {mine!r}, SGLang {sglang!r}")

    first = plans[0].decisions

    def value(decisions, key):
        d = decisions.get(key)
        return d.value if d is not None else "<missing>"

    same(Keys.SHARED_EXPERTS_FUSION, value(first, Keys.SHARED_EXPERTS_FUSION), answer["shared_experts_fusion"])
    # The MoE runner SGLang's resolution leaves, on every point it runs: the registry records it on every plan.
    same(RUNNER_KEY, value(first, RUNNER_KEY), (answer.get("rewritten") or {}).get("moe_runner_backend"))
    if answer.get("forward_path") is not None:
        same(Keys.FORWARD_PATH, value(first, Keys.FORWARD_PATH), answer["forward_path"])
        same(Keys.POST_EXPERTS_ALL_REDUCE, value(first, Keys.POST_EXPERTS_ALL_REDUCE),
             answer["post_experts_all_reduce"])
    for rank, plan in enumerate(plans):
        if answer.get("pp_layer_ranges"):
            same(f"{Keys.PP_LAYER_RANGE}[pp_rank={rank}]", _listed(value(plan.decisions, Keys.PP_LAYER_RANGE)),
                 answer["pp_layer_ranges"][rank])
        if point.get("eplb"):
            same(f"{Keys.EPLB_ENABLED}[pp_rank={rank}]", value(plan.decisions, Keys.EPLB_ENABLED),
                 answer["eplb_enabled"])
            if answer["eplb_enabled"] and answer.get("eplb_layers") is not None:
                same(f"{Keys.EPLB_LAYERS}[pp_rank={rank}]", _listed(value(plan.decisions, Keys.EPLB_LAYERS)),
                     answer["eplb_layers"][rank])
    if diffs:
        return Verdict(False, "; ".join(d.split(":")[0] for d in diffs), diffs)
    return Verdict(True, KIND_EQUAL)


def _listed(v):
    return list(v) if isinstance(v, (list, tuple)) else v


def summarize(records: list[dict], release: str = "") -> tuple[collections.Counter, list[tuple[dict, Verdict]]]:
    kinds: collections.Counter = collections.Counter()
    failures = []
    for rec in records:
        v = verdict(rec["point"], rec["answer"], release)
        kinds[("agree" if v.agrees else "DIFFER") + ": " + v.kind] += 1
        if not v.agrees:
            failures.append((rec["point"], v))
    return kinds, failures


def report(records: list[dict], kinds: collections.Counter, failures: list, show: int = 20,
           release: str = "") -> str:
    total = len(records)
    agreed = total - len(failures)
    lines = [f"sglang {release or NEWEST.version} conformance: {agreed}/{total} points agree "
             f"({100.0 * agreed / max(total, 1):.1f}%)"]
    by_grid = collections.Counter(r["point"].get("grid") for r in records)
    bad_grid = collections.Counter(p.get("grid") for p, _ in failures)
    lines.append("  per subgrid: " + ", ".join(f"{g} {by_grid[g] - bad_grid[g]}/{by_grid[g]}" for g in sorted(by_grid)))
    for kind, n in kinds.most_common():
        lines.append(f"  {n:6d}  {kind}")
    # A few of each kind of difference, so one kind does not hide the others.
    shown, per_kind = 0, collections.Counter()
    for point, v in failures:
        if shown >= show or per_kind[v.kind] >= 3:
            continue
        per_kind[v.kind] += 1
        shown += 1
        lines.append(f"  DIFFER {point_name(point)}: {' | '.join(v.differences)}")
    if len(failures) > shown:
        lines.append(f"  ... and {len(failures) - shown} more")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="the sglang profile of each release against that release's grid")
    parser.add_argument("releases", nargs="*", default=list(RELEASES), help="default: every profiled release")
    args = parser.parse_args(argv)
    bad = 0
    for release in args.releases:
        header, records = load_recording(recording_of(release))
        kinds, failures = summarize(records, release)
        print(f"recording: sglang {header['sglang']}, {header['points']} points, {header['recorded_at']}")
        print(report(records, kinds, failures, show=40, release=release))
        bad += len(failures)
    return 0 if not bad else 1


if __name__ == "__main__":
    raise SystemExit(main())
