"""`loadplan generate`: greedy (or speculative) generation from a checkpoint folder.

    loadplan generate --model DIR --prompt-ids 1,2,3 --max-new-tokens N [--draft DIR] [--json]

It takes the runtime flags of `loadplan resolve` (cli/options.py), so the plan a runner gets
here is the plan `resolve` shows for the same flags. One process (`--nproc 1`, the default)
resolves the target's plan, and the draft's under the same deployment with role
`speculative`, loads both through `load_model` and decodes in-process. `--nproc N` launches
N ranks (engine/worker.py), each resolving its own plans at its own instantiation point.

stdout carries only the result (a JSON document with --json); progress bars go to stderr,
and only when it is a terminal and --json is off. Failures are one line on stderr,
`error: STATUS: message`, with the CLI's exit codes (cli/errors.py).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import sys
import uuid
from typing import Any, Iterator

from .errors import EXIT_FAILURE, CliError, one_line
from .options import (add_registry_arguments, add_runner_arguments, default_db_url, embedded_registry, open_client,
                      parallel_from_args, read_config, runtime_from_args)

DEFAULT_NUM_DRAFT_TOKENS = 4


def _token_ids(text: str) -> list[int]:
    parts = [p for p in re.split(r"[,\s]+", text.strip()) if p]
    if not parts:
        raise argparse.ArgumentTypeError("expected comma-separated token ids, e.g. 1,2,3; got nothing")
    try:
        ids = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integer token ids, e.g. 1,2,3; got {text!r}") \
            from None
    bad = [i for i in ids if i < 0]
    if bad:
        raise argparse.ArgumentTypeError(f"token ids are >= 0, got {bad[0]}")
    return ids


DTYPES = ("float32", "bfloat16", "float16")


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="DIR", help="target checkpoint folder (config.json + "
                        "*.safetensors)")
    parser.add_argument("--prompt-ids", required=True, type=_token_ids, metavar="IDS", help="e.g. 1,2,3")
    parser.add_argument("--max-new-tokens", type=int, default=16, metavar="N", help="default 16")
    parser.add_argument("--draft", metavar="DIR", help="draft checkpoint for speculative decoding (same vocabulary)")
    parser.add_argument("--num-draft-tokens", type=int, default=DEFAULT_NUM_DRAFT_TOKENS, metavar="K",
                        help=f"tokens the draft proposes per target forward (default {DEFAULT_NUM_DRAFT_TOKENS})")
    parser.add_argument("--nproc", type=int, default=1, metavar="N",
                        help="processes (ranks) to launch with torch.distributed (default 1: in this process)")
    parser.add_argument("--rank-timeout", type=float, default=300.0, metavar="SECONDS",
                        help="with --nproc: bound on the ranks' run and on each collective (default 300)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="the dtype the models are built and run in (default float32; checkpoints are cast)")
    add_registry_arguments(parser)
    add_runner_arguments(parser, engine=False)   # the worker runs loadplan's engine: it asks for that
    parser.add_argument("--json", action="store_true", help="print {tokens, plan_id, ...} as JSON")


def run_generate(args: argparse.Namespace) -> int:
    _check_numbers(args)
    config = read_config(args.model)
    vocab = _vocab_size(config)
    if vocab is not None and max(args.prompt_ids) >= vocab:
        raise CliError("INVALID_ARGUMENT", f"--prompt-ids: token id {max(args.prompt_ids)} is outside the "
                       f"model's vocabulary (vocab_size={vocab})")
    if args.draft is not None:
        if args.role != "target":
            raise CliError("INVALID_ARGUMENT", f"--role {args.role} with --draft: the model is the target, the "
                           f"draft gets role speculative")
        draft_vocab = _vocab_size(read_config(args.draft))
        if draft_vocab != vocab:
            raise CliError("INVALID_ARGUMENT", f"--draft: the draft must share the target's vocabulary: target "
                           f"vocab_size={vocab}, draft vocab_size={draft_vocab}")
    # Target and draft are runners of one deployment; without --deployment they get a fresh one together.
    args.deployment = args.deployment or uuid.uuid4().hex
    result = _run_distributed(args) if args.nproc > 1 else _run_here(args)
    _print_result(args, result)
    return 0


def _check_numbers(args) -> None:
    if args.max_new_tokens < 0:
        raise CliError("INVALID_ARGUMENT", f"--max-new-tokens: must be >= 0, got {args.max_new_tokens}")
    if args.num_draft_tokens < 1:
        raise CliError("INVALID_ARGUMENT", f"--num-draft-tokens: must be >= 1, got {args.num_draft_tokens}")
    if args.nproc < 1:
        raise CliError("INVALID_ARGUMENT", f"--nproc: must be >= 1, got {args.nproc}")
    for axis in ("tp", "ep", "pp"):
        if getattr(args, f"{axis}_size") < 1:
            raise CliError("INVALID_ARGUMENT", f"--{axis}-size: must be >= 1, got {getattr(args, f'{axis}_size')}")
        if getattr(args, f"{axis}_rank") != 0:
            raise CliError("INVALID_ARGUMENT", f"--{axis}-rank: generate launches every rank itself (--nproc); "
                           f"a rank is not chosen by hand")
    ranks = args.tp_size * args.ep_size * args.pp_size
    if args.nproc == 1 and ranks > 1:
        raise CliError("INVALID_ARGUMENT", f"--tp-size {args.tp_size} --ep-size {args.ep_size} --pp-size "
                       f"{args.pp_size} make {ranks} ranks: pass --nproc {ranks}")


def _vocab_size(config: dict[str, Any]) -> int | None:
    for cfg in (config, config.get("text_config")):   # a wrapper holds its text body's config
        if isinstance(cfg, dict) and isinstance(cfg.get("vocab_size"), int):
            return cfg["vocab_size"]
    return None


def _torch_device(name: str):
    import torch

    if re.fullmatch(r"(cuda|hip|musa):\d+\.\d+", name):
        raise CliError("INVALID_ARGUMENT", f"--device {name}: generate runs on a torch device (cpu, cuda, cuda:N); "
                       f"the registry's spelling of it is derived from the device itself")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as e:
        raise CliError("INVALID_ARGUMENT", f"--device: {one_line(e)}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CliError("FAILED_PRECONDITION", f"--device {name}: this torch sees no CUDA device")
    if device.type not in ("cpu", "cuda"):
        raise CliError("INVALID_ARGUMENT", f"--device {name}: not supported; supported: cpu, cuda, cuda:N")
    return device


def _load_kwargs(args) -> dict[str, Any]:
    """load_model's parallel layout, runtime and keywords from the flags `resolve` shares."""
    return dict(parallel=parallel_from_args(args), runtime=runtime_from_args(args), deployment=args.deployment,
                quantization=args.quantization, device=_torch_device(args.device))


@contextlib.contextmanager
def engine_errors() -> Iterator[None]:
    """The engine's refusals (bad checkpoint, config, layout, vocabulary) as one-line CLI errors."""
    try:
        yield
    except CliError:
        raise
    except NotImplementedError as e:
        raise CliError("UNIMPLEMENTED", one_line(e)) from None
    except (ValueError, FileNotFoundError) as e:
        raise CliError("INVALID_ARGUMENT", one_line(e)) from None
    except OSError as e:
        raise CliError("UNAVAILABLE" if isinstance(e, ConnectionError) else "INVALID_ARGUMENT", one_line(e)) \
            from None


def _bar(args, **kw):
    from tqdm import tqdm

    return tqdm(file=sys.stderr, disable=args.json or not sys.stderr.isatty(), leave=False, **kw)


def _run_here(args) -> dict[str, Any]:
    import torch

    from loadplan.engine.generate import checkpoint_eos, generate
    from loadplan.engine.loader import load_model
    from loadplan.engine.speculative import speculative_generate

    kw = dict(_load_kwargs(args), dtype=getattr(torch, args.dtype))
    with engine_errors():
        with open_client(args) as client, _bar(args, total=2 if args.draft else 1, desc="loading",
                                               unit="model") as bar:
            target = load_model(args.model, registry=client, role=args.role, request_id=args.request_id, **kw)
            bar.update(1)
            draft = None
            if args.draft is not None:
                draft = load_model(args.draft, registry=client, role="speculative",
                                   request_id=f"{args.request_id}-draft" if args.request_id else None, **kw)
                bar.update(1)
        eos = checkpoint_eos(args.model)
        with _bar(args, total=args.max_new_tokens, desc="generating", unit="tok") as bar:
            if draft is None:
                # one forward per token (the prefill gives the first)
                hook = target.register_forward_hook(lambda *_: bar.update(1))
                try:
                    tokens = generate(target, args.prompt_ids, args.max_new_tokens, eos_token_id=eos)[0].tolist()
                finally:
                    hook.remove()
            else:
                tokens, stats = speculative_generate(target, draft, args.prompt_ids, args.max_new_tokens,
                                                     args.num_draft_tokens, eos_token_id=eos, on_tokens=bar.update)
    result: dict[str, Any] = {"tokens": tokens, "plan_id": target.plan.plan_id, "deployment_id": args.deployment}
    if draft is not None:
        result.update(draft_plan_id=draft.plan.plan_id, acceptance_rate=stats["acceptance_rate"],
                      proposed=stats["proposed"], accepted=stats["accepted"])
    return result


# Security flags -> the environment variables a rank's RegistryClient reads (client/auth.py); the ranks
# get this process's environment when they are launched.
_SECURITY_ENV = (("token", "LOADPLAN_TOKEN"), ("token_file", "LOADPLAN_TOKEN_FILE"), ("tls_ca", "LOADPLAN_TLS_CA"),
                 ("tls_cert", "LOADPLAN_TLS_CERT"), ("tls_key", "LOADPLAN_TLS_KEY"))


@contextlib.contextmanager
def _rank_environment(args) -> Iterator[None]:
    given = {env: str(getattr(args, attr)) for attr, env in _SECURITY_ENV if getattr(args, attr, None)}
    if (given or args.tls) and not args.registry:
        raise CliError("INVALID_ARGUMENT", "--token/--tls flags need --registry HOST:PORT: the embedded registry "
                       "runs on loopback, without authentication or TLS")
    if args.tls and not args.tls_ca:
        raise CliError("INVALID_ARGUMENT", f"--tls with --nproc {args.nproc}: the ranks trust the CA of --tls-ca "
                       f"FILE (or $LOADPLAN_TLS_CA); pass it")
    saved = {env: os.environ.get(env) for env in given}
    os.environ.update(given)
    try:
        yield
    finally:
        for env, value in saved.items():
            if value is None:
                os.environ.pop(env, None)
            else:
                os.environ[env] = value


def _run_distributed(args) -> dict[str, Any]:
    try:
        from loadplan.engine.parallel.launch import RankFailed
        from loadplan.engine.worker import WorkerSpec, generate_distributed
    except ImportError as e:
        raise CliError("FAILED_PRECONDITION", f"--nproc {args.nproc}: multi-rank generation is not available in "
                       f"this build ({one_line(e)})", EXIT_FAILURE) from None
    if args.request_id:
        raise CliError("INVALID_ARGUMENT", f"--request-id names one runner's request; with --nproc {args.nproc} "
                       f"every rank makes its own")
    if args.role != "target":
        raise CliError("INVALID_ARGUMENT", f"--role {args.role}: with --nproc the model is the target (a draft "
                       f"comes with --draft)")
    _torch_device(args.device)    # each rank takes its device from the process group (gloo: cpu, nccl: cuda)
    try:
        spec = WorkerSpec(model=str(args.model), prompt_ids=tuple(args.prompt_ids),
                          max_new_tokens=args.max_new_tokens, ep_size=args.ep_size, pp_size=args.pp_size,
                          tp_size=args.tp_size, deployment=args.deployment, registry=args.registry,
                          runtime=runtime_from_args(args), quantization=args.quantization,
                          draft=str(args.draft) if args.draft else None, num_draft_tokens=args.num_draft_tokens,
                          dtype=args.dtype)
    except ValueError as e:
        raise CliError("INVALID_ARGUMENT", one_line(e)) from None
    try:
        with _rank_environment(args), contextlib.ExitStack() as stack:
            if spec.registry is None:   # the embedded default: one registry in this process for every rank
                reg = stack.enter_context(embedded_registry(args.db or default_db_url()))
                spec = dataclasses.replace(spec, registry=reg.address)
            res = generate_distributed(spec, args.nproc, timeout_s=args.rank_timeout)
    except RankFailed as e:
        status, message = rank_error(e.error)
        raise CliError(status, f"rank {e.rank} of {args.nproc} failed: {message}") from None
    except ValueError as e:        # sizes that do not make the number of ranks, ...
        raise CliError("INVALID_ARGUMENT", one_line(e)) from None
    result: dict[str, Any] = {"tokens": res["tokens"], "plan_id": res["plan_ids"][0],
                              "deployment_id": res["deployment"], "plan_ids": res["plan_ids"]}
    if args.draft is not None:
        result.update(draft_plan_id=res["draft_plan_ids"][0], acceptance_rate=res["acceptance_rate"],
                      proposed=res["proposed"], accepted=res["accepted"], draft_plan_ids=res["draft_plan_ids"])
    return result


# A rank's exception class (the last line of its traceback) -> the status the CLI reports.
_BAD_INPUT_ERRORS = frozenset({"ValueError", "FileNotFoundError", "ConfigError", "CheckpointError", "WeightError",
                               "MissingTensor", "UnexpectedTensor", "DuplicateTensor", "ShapeMismatch",
                               "LayoutMismatch", "VocabMismatch", "UnsupportedModel", "Fp8ConfigError"})


def rank_error(text: str) -> tuple[str, str]:
    """(status, one-line message) of a failed rank's report (its traceback, or the launcher's words)."""
    lines = [l.strip() for l in str(text).strip().splitlines() if l.strip()]
    if not lines:
        return "INTERNAL", "the rank reported no error text"
    if not lines[0].startswith("Traceback"):       # the launcher's own words: no answer in time, a rank died
        timed_out = "within" in lines[0] or "timeout" in lines[0]
        return ("DEADLINE_EXCEEDED" if timed_out else "INTERNAL"), one_line(lines[0])
    m = re.match(r"^([A-Za-z_][\w.]*): (.*)$", lines[-1])
    if not m:
        return "INTERNAL", one_line(lines[-1])
    name, message = m.group(1).rsplit(".", 1)[-1], m.group(2)
    status = re.match(r"^([A-Z][A-Z_]+): (.*)$", message)      # a registry error: "NOT_FOUND: ..."
    if status:
        return status.group(1), one_line(status.group(2))
    if name == "NotImplementedError":
        return "UNIMPLEMENTED", one_line(message)
    return ("INVALID_ARGUMENT" if name in _BAD_INPUT_ERRORS else "INTERNAL"), one_line(f"{name}: {message}")


def _print_result(args, result: dict[str, Any]) -> None:
    if args.json:
        print(json.dumps(result))
        return
    line = f"tokens: {' '.join(map(str, result['tokens']))}  (plan {result['plan_id']}"
    if "draft_plan_id" in result:
        line += (f", draft plan {result['draft_plan_id']}, acceptance {result['acceptance_rate']:.2f} = "
                 f"{result['accepted']}/{result['proposed']} draft tokens")
    print(line + ")")
