"""The engine inputs a request sends, checked and read as its profile declares (loadplan/engine_inputs.py):
- a value the profile reads is parsed as the engine parses it; malformed: INVALID_ARGUMENT naming it;
- an argument that means the same as a typed Runtime or Parallel field must agree with it (refused naming both);
- a name the profile does not read is kept (the request, and so the history and the pins) and listed in the plan
  (decision `engine.inputs_not_read`).
"""

from __future__ import annotations

from typing import Any

from loadplan.engine_inputs import READS, EngineInput
from loadplan.errors import InvalidArgument
from loadplan.plan import ResolveRequest

MAX_NAME = 128
MAX_VALUE = 4096


def reads(engine: str) -> dict[tuple[str, str], EngineInput]:
    return {(r.kind, r.name): r for r in READS.get(engine, ())}


def check_shape(req: ResolveRequest) -> None:
    """Names and values are short text (the history keeps them), before any engine is known."""
    for kind in ("args", "env"):
        for n, v in getattr(req.runtime, f"engine_{kind}"):
            field = f"runtime.engine_{kind}"
            if not isinstance(n, str) or not n or len(n) > MAX_NAME or not n.isprintable():
                raise InvalidArgument(field, f"a name must be 1 to {MAX_NAME} printable characters, got {n!r:.80}")
            if not isinstance(v, str) or len(v) > MAX_VALUE:
                raise InvalidArgument(f"{field}.{n}", f"the value must be text of at most {MAX_VALUE} characters")


def typed_value(req: ResolveRequest, same_as: str) -> Any:
    part, attr = same_as.split(".")
    return getattr(req.runtime if part == "runtime" else req.parallel, attr)


def values(req: ResolveRequest, engine: str) -> tuple[dict[str, Any], list[str]]:
    """(what the profile reads, by name, parsed; the names sent that it does not read). Malformed values and
    arguments that disagree with their typed field are refused."""
    table = reads(engine)
    read: dict[str, Any] = {}
    for r in table.values():
        given = (req.runtime.arg if r.kind == "arg" else req.runtime.env)(r.name)
        try:
            value = r.parse(r.default if given is None else given)
        except ValueError as e:
            raise InvalidArgument(r.field, f"{e} ({r.where})") from None
        if given is not None and r.same_as:
            typed = typed_value(req, r.same_as)
            mine = r.none_is if (r.none_is and value in ("", "None")) else value
            if r.same_as == "runtime.moe_runner_backend" and typed == "":
                typed = "auto"
            if mine != typed:
                raise InvalidArgument(r.field, f"{given!r}, but {r.same_as} is {typed!r}: they mean the same "
                                         f"({r.where}) and must agree")
        read[r.name] = value
    not_read = sorted(f"{kind}:{n}" for kind, pairs in (("arg", req.runtime.engine_args),
                                                         ("env", req.runtime.engine_env))
                      for n, _ in pairs if (kind, n) not in table)
    return read, not_read
