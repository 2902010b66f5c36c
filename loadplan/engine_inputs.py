"""The engine's own inputs each profile reads: server arguments and environment switches, as the engine spells them.

One table every side reads: the registry's rules (service/rules/engine_inputs.py checks and reads the values) and the
adapters, which send these names from what their engine holds (the SGLang adapter its ServerArgs and environment,
the vLLM plugin its config and environment). Pure data and the engines' own parsing: no grpc, no SQL, no torch.

A runner sends what its engine holds (`Runtime.engine_args`: SGLang's ServerArgs fields, vLLM's config fields;
`Runtime.engine_env`: the switches). A profile declares here the names its decisions read, with the engine's
default and the engine's own parsing; then:
- a value it reads changes the answer exactly as it changes the engine's;
- an argument that means the same as a typed Runtime or Parallel field must agree with it (refused naming both);
- a name it does not read is kept (in the request, and so in the history and the pins) and listed in the plan
  (decision `engine.inputs_not_read`);
- a malformed value is INVALID_ARGUMENT naming it (`runtime.engine_env.NAME`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from loadplan.plan import ENGINE_LOADPLAN, ENGINE_SGLANG, ENGINE_VLLM, ResolveRequest

def sglang_bool(text: str) -> bool:
    """SGLang's get_bool_env_var (srt/utils/common.py): "true"/"1" and "false"/"0", any case. SGLang takes any other
    value as false with a warning; the registry refuses it, so that the operator's intent is not guessed."""
    value = text.lower()
    if value not in ("true", "1", "false", "0"):
        raise ValueError(f"{text!r} is not a boolean as SGLang reads one (true, 1, false or 0)")
    return value in ("true", "1")


def server_bool(text: str) -> bool:
    """A boolean server argument as its adapter sends it (Python's str of the value)."""
    value = text.lower()
    if value not in ("true", "false"):
        raise ValueError(f"{text!r} is not a boolean (True or False)")
    return value == "true"


def integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{text!r} is not an integer") from None


def name(text: str) -> str:
    return text


@dataclass(frozen=True)
class EngineInput:
    kind: str                       # "arg" (engine_args) or "env" (engine_env)
    name: str                       # as the engine spells it
    default: str                    # the engine's default, as text
    parse: Callable[[str], Any]     # the engine's own reading; ValueError: malformed
    where: str                      # where the engine reads it
    same_as: str = ""               # the typed field that means the same ("runtime.a2a_backend", "parallel.tp_size")
    none_is: str = ""               # the typed field's value for the engine's None ("none" for moe_a2a_backend)

    @property
    def field(self) -> str:
        return f"runtime.{'engine_args' if self.kind == 'arg' else 'engine_env'}.{self.name}"


def _arg(name_: str, default: str, parse, where: str, same_as: str = "", none_is: str = "") -> EngineInput:
    return EngineInput("arg", name_, default, parse, where, same_as, none_is)


def _env(name_: str, default: str, parse, where: str) -> EngineInput:
    return EngineInput("env", name_, default, parse, where)


_SERVER_ARGS = "srt/server_args.py: ServerArgs"
# What each engine's profile reads (every release of it: a release that reads another name gets a row of its own).
READS: dict[str, tuple[EngineInput, ...]] = {
    ENGINE_SGLANG: (
        _env("SGLANG_USE_AITER", "false", sglang_bool,
             "srt/models/qwen2_moe.py: _use_aiter (with is_hip()): the Qwen2-MoE block fuses on ROCm"),
        _arg("moe_a2a_backend", "none", name, _SERVER_ARGS, "runtime.a2a_backend", none_is="none"),
        _arg("moe_runner_backend", "auto", name, _SERVER_ARGS, "runtime.moe_runner_backend"),
        _arg("enable_eplb", "False", server_bool, _SERVER_ARGS, "runtime.enable_eplb"),
        _arg("ep_num_redundant_experts", "0", integer, _SERVER_ARGS, "runtime.ep_num_redundant_experts"),
        _arg("disable_shared_experts_fusion", "False", server_bool, _SERVER_ARGS,
             "runtime.disable_shared_experts_fusion"),
        _arg("enforce_shared_experts_fusion", "False", server_bool, _SERVER_ARGS,
             "runtime.enforce_shared_experts_fusion"),
        _arg("enable_single_batch_overlap", "False", server_bool, _SERVER_ARGS, "runtime.enable_sbo"),
        _arg("enable_two_batch_overlap", "False", server_bool, _SERVER_ARGS, "runtime.enable_tbo"),
        # SGLang's tp_size is the whole TP group (loadplan's tp x ep, DESIGN 8.1) and its ep_size may be rewritten
        # to it: those are sent through `parallel` as the published ranks say; the stages mean the same.
        _arg("pp_size", "1", integer, _SERVER_ARGS, "parallel.pp_size"),
    ),
    ENGINE_VLLM: (
        _arg("all2all_backend", "allgather_reducescatter", name, "config/parallel.py: ParallelConfig",
             "runtime.a2a_backend"),
        _arg("enable_eplb", "False", server_bool, "config/parallel.py: ParallelConfig", "runtime.enable_eplb"),
        _arg("tensor_parallel_size", "1", integer, "config/parallel.py: ParallelConfig", "parallel.tp_size"),
        _arg("pipeline_parallel_size", "1", integer, "config/parallel.py: ParallelConfig", "parallel.pp_size"),
        _arg("data_parallel_size", "1", integer, "config/parallel.py: ParallelConfig", "parallel.dp_size"),
    ),
    ENGINE_LOADPLAN: (),
}


def names(engine: str, kind: str) -> tuple[str, ...]:
    """The names of `kind` ("arg" or "env") the engine's profile reads."""
    return tuple(r.name for r in READS.get(engine, ()) if r.kind == kind)
