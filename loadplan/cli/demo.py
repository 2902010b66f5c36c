"""`loadplan demo` (`make demo`): the whole path on the embedded default, in one command.

1. make tiny checkpoints (engine/make_checkpoints.py): a DeepSeek-V3-style target with
   256 routed experts (so the fusion gate passes) and its drafts: a Qwen3-MoE model with
   the same vocabulary (another family: the runners' fusion decisions differ), or with
   `--draft nextn` the target's own Multi-Token-Prediction layer, DeepSeek's draft (the
   same architecture code: DESIGN 1's case, where both runners fuse and only the family
   and the layers differ);
2. start the registry in this process on a loopback port, on a SQLite file in the demo
   directory (the real server: DESIGN 3's embedded default);
3. run a worker of 2 expert-parallel ranks (torch.distributed, gloo on CPU), each with the
   target runner and a speculative draft runner; every runner resolves its own plan
   through the registry at its single instantiation point;
4. print the plans side by side (target vs draft: decisions, values, reasons) and the
   registry's audit diff of the two, then how to explore the history further.

Progress bars (loading, generation) go to stderr; the report goes to stdout. The demo
directory is kept: its database is the history the printed commands read.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from ..plan import Runtime
from .errors import CliError, one_line

DEFAULT_DIR = "demo-out"
DEFAULT_PROMPT = "5,17,42"
# --draft: (make_checkpoints' folder, what the report says of it).
DRAFTS = {
    "qwen3": ("draft", "Qwen3MoeForCausalLM, same vocabulary"),
    "nextn": ("nextn", "DeepseekV3ForCausalLMNextN, the target's Multi-Token-Prediction layer"),
}


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", default=DEFAULT_DIR, metavar="DIR",
                        help=f"where the checkpoints and the SQLite history go (default ./{DEFAULT_DIR})")
    parser.add_argument("--nproc", type=int, default=2, metavar="N",
                        help="expert-parallel ranks of the worker (default 2)")
    parser.add_argument("--a2a-backend", default="none", metavar="NAME", help="a2a backend (see `loadplan backends`)")
    parser.add_argument("--draft", default="qwen3", choices=sorted(DRAFTS),
                        help="the speculative draft: qwen3 (a Qwen3-MoE model, the default) or nextn (the "
                             "target's own MTP layer)")
    parser.add_argument("--prompt-ids", default=DEFAULT_PROMPT, metavar="IDS", help=f"default {DEFAULT_PROMPT}")
    parser.add_argument("--max-new-tokens", type=int, default=24, metavar="N", help="default 24")
    parser.add_argument("--num-draft-tokens", type=int, default=4, metavar="K", help="default 4")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def run_demo(args: argparse.Namespace) -> int:
    if args.nproc < 1 or args.max_new_tokens < 1 or args.num_draft_tokens < 1:
        raise CliError("INVALID_ARGUMENT", "--nproc, --max-new-tokens and --num-draft-tokens must be >= 1")
    try:
        prompt = [int(t) for t in args.prompt_ids.replace(" ", ",").split(",") if t]
    except ValueError:
        raise CliError("INVALID_ARGUMENT", f"--prompt-ids: expected comma-separated token ids, got "
                       f"{args.prompt_ids!r}") from None
    from loadplan.engine.make_checkpoints import VOCAB, make_checkpoints
    from loadplan.service.embedded import EmbeddedRegistry

    if not prompt or not all(0 <= t < VOCAB for t in prompt):
        raise CliError("INVALID_ARGUMENT", f"--prompt-ids: token ids must be in [0, {VOCAB}) (the demo "
                       f"checkpoints' vocabulary), got {args.prompt_ids!r}")

    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    db_url = f"sqlite:///{root / 'loadplan.db'}"
    started = time.monotonic()
    say = _Printer()

    say.step("checkpoints", f"tiny random checkpoints in {root / 'checkpoints'}")
    try:
        paths = make_checkpoints(root / "checkpoints")
    except ImportError as e:
        raise CliError("FAILED_PRECONDITION", f"the demo makes its checkpoints with transformers ({one_line(e)}); "
                       f"pip install 'loadplan[dev]'") from None
    say.line(f"target  {paths['target']}  DeepseekV3ForCausalLM, 256 routed experts + 1 shared")
    folder, what = DRAFTS[args.draft]
    say.line(f"draft   {paths[folder]}  {what}")

    with EmbeddedRegistry(db_url) as registry, registry.client() as client:
        say.step("registry", f"embedded, {registry.address}, history in {db_url}")
        deployment = f"demo-{uuid.uuid4().hex[:8]}"
        say.step("worker", f"{args.nproc} EP rank(s) x (target + draft), a2a backend {args.a2a_backend}, "
                           f"deployment {deployment}")
        result = run_worker(target=str(paths["target"]), draft=str(paths[folder]), prompt=prompt,
                            max_new_tokens=args.max_new_tokens, num_draft_tokens=args.num_draft_tokens,
                            nproc=args.nproc, a2a_backend=args.a2a_backend, deployment=deployment,
                            registry=registry.address, progress=not args.no_progress)
        say.line(f"prompt  {' '.join(map(str, prompt))}")
        say.line(f"output  {' '.join(map(str, result['tokens']))}")
        say.line(f"draft acceptance {result['acceptance_rate']:.2f} ({result['accepted']}/{result['proposed']} "
                 f"proposed tokens); the output is exactly the target's greedy tokens")

        plans = list(client.iter_plans(deployment_id=deployment))
        target, draft = _rank0(plans, "target"), _rank0(plans, "speculative")
        say.step("plans", f"{len(plans)} plans recorded for deployment {deployment}")
        say.line(_ranks_summary(plans))
        print()
        print(comparison_table(target, draft))
        print()
        diff = client.diff_plans(target.plan_id, draft.plan_id)
        say.step("audit diff", f"`loadplan plans diff {target.plan_id} {draft.plan_id}`")
        print(diff_table(diff))
    print()
    print(f"done in {time.monotonic() - started:.0f}s. Explore the history:")
    print(f"  .venv/bin/loadplan plans list --db {db_url} --deployment {deployment}")
    print(f"  .venv/bin/loadplan plans show {target.plan_id} --db {db_url}")
    print(f"  .venv/bin/loadplan plans diff {target.plan_id} {draft.plan_id} --db {db_url}")
    return 0


def run_worker(*, target: str, draft: str, prompt: list[int], max_new_tokens: int, num_draft_tokens: int,
               nproc: int, a2a_backend: str, deployment: str, registry: str, progress: bool) -> dict[str, Any]:
    """Target + draft generation on `nproc` EP ranks: {tokens, acceptance_rate, accepted, proposed}.

    The ranks are the worker's (engine/worker.py: its spec, grid and `load_runner`, so
    every runner resolves its own plan at the single instantiation point); the demo's rank
    function only adds progress bars, drawn by rank 0."""
    from loadplan.engine.parallel.launch import RankFailed, launch
    from loadplan.engine.worker import WorkerSpec

    spec = WorkerSpec(model=target, draft=draft, prompt_ids=tuple(prompt), max_new_tokens=max_new_tokens,
                      num_draft_tokens=num_draft_tokens, ep_size=nproc, runtime=Runtime(a2a_backend=a2a_backend),
                      deployment=deployment, registry=registry)
    try:
        ranks = launch(nproc, demo_rank, spec, progress)
    except RankFailed as e:
        from .generate import rank_error

        status, message = rank_error(e.error)
        raise CliError(status, f"rank {e.rank} of {nproc} failed: {message}") from None
    tokens = ranks[0]["tokens"]
    if any(r["tokens"] != tokens for r in ranks):
        raise CliError("INTERNAL", f"the ranks disagree on the tokens: {[r['tokens'] for r in ranks]}")
    return {"tokens": tokens, **ranks[0]["stats"]}


def demo_rank(rank: int, world_size: int, spec, progress: bool) -> dict[str, Any]:
    """One rank: the worker's runners (target, then draft) and speculative decoding, with progress bars."""
    from tqdm import tqdm

    from loadplan.engine.generate import checkpoint_eos
    from loadplan.engine.speculative import speculative_generate
    from loadplan.engine.worker import init_rank, load_runner

    show = progress and rank == 0
    grid = init_rank(spec)
    with tqdm(total=2, desc="loading", unit="runner", file=sys.stderr, disable=not show) as bar:
        target = load_runner(spec, grid, "target")
        bar.update(1)
        draft = load_runner(spec, grid, "speculative")
        bar.update(1)
    with tqdm(total=spec.max_new_tokens, desc="generating", unit="tok", file=sys.stderr, disable=not show) as bar:
        tokens, stats = speculative_generate(target, draft, list(spec.prompt_ids), spec.max_new_tokens,
                                             spec.num_draft_tokens, eos_token_id=checkpoint_eos(spec.model) or None,
                                             on_tokens=bar.update)
    return {"tokens": [int(t) for t in tokens], "stats": dict(stats)}


# --- the report --------------------------------------------------------------------------

class _Printer:
    def __init__(self):
        self.n = 0

    def step(self, what: str, detail: str) -> None:
        self.n += 1
        print(f"[{self.n}] {what}: {detail}", flush=True)

    def line(self, text: str) -> None:
        print(f"    {text}", flush=True)


def _rank0(plans, role):
    mine = [p for p in plans if p.request.role == role]
    if not mine:
        raise CliError("INTERNAL", f"no {role} plan was recorded")
    return min(mine, key=lambda p: (p.request.parallel.ep_rank, p.request.parallel.pp_rank))


def _ranks_summary(plans) -> str:
    """Every rank of one role must hold the same deployment-wide decisions (the registry pins them)."""
    parts = []
    for role in ("target", "speculative"):
        mine = [p for p in plans if p.request.role == role]
        wide = {tuple(sorted((k, repr(d.value)) for k, d in p.decisions.items() if d.deployment_wide)) for p in mine}
        parts.append(f"{role}: {len(mine)} rank(s), deployment-wide decisions "
                     f"{'identical' if len(wide) == 1 else 'DIFFER'}")
    return "; ".join(parts)


def _text(value: Any) -> str:
    import json

    return json.dumps(value)


def comparison_table(target, draft) -> str:
    """Decision by decision: the value each runner got, then why (reason and rule)."""
    from .output import table

    rows = []
    for key in sorted(set(target.decisions) | set(draft.decisions)):
        t, d = target.decisions.get(key), draft.decisions.get(key)
        mark = "" if (t and d and t.value == d.value) else "*"
        rows.append((key + mark, _text(t.value) if t else "-", _text(d.value) if d else "-",
                     f"target: {t.reason} [{t.rule}]" if t else ""))
        rows.append(("", "", "", f"draft:  {d.reason} [{d.rule}]" if d else ""))
    head = (f"target: {target.entry_class} (plan {target.plan_id})\n"
            f"draft:  {draft.entry_class} (plan {draft.plan_id})\n"
            f"* the runners' values differ: each runner got its own plan, the draft never rewrote the target's\n")
    return head + "\n" + table(("DECISION", "TARGET", "DRAFT", "WHY"), rows)


def diff_table(diff) -> str:
    from .output import table

    out = []
    if diff.decisions:
        out.append(table(("KEY", "TARGET", "DRAFT"),
                         ((k, _text(a.value) if a else "-", _text(b.value) if b else "-")
                          for k, a, b in diff.decisions)))
    else:
        out.append("no decision differs")
    if diff.inputs:
        out.append("")
        out.append(table(("INPUT", "TARGET", "DRAFT"),
                         ((f, _shorten(_text(a)), _shorten(_text(b))) for f, a, b in diff.inputs)))
    return "\n".join(out)


def _shorten(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."
