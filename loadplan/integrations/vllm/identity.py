"""Who this vLLM runner is, in the registry's words: a `ResolveRequest` with `runtime.engine = "vllm"`.

`WorkerIdentity` holds what vLLM knows about the runner as plain values; `identity_of` reads it
from vLLM's objects inside the worker (needs vLLM), `resolve_request` turns it into the request
(pure). Sizes and ranks are those of the worker's process groups, which vLLM's layers read
(`get_tp_group()`, `get_pp_group()`, `get_dp_group()`), not of the `ParallelConfig` the model is built
under: a draft model (`speculative_config`, method draft_model) is built under vLLM's own draft
ParallelConfig (`SpeculativeConfig.create_draft_parallel_config`: pipeline_parallel_size 1,
data_parallel_size 1, the default all2all backend, EP only for an MoE draft) in the target's
workers and groups. So:

- `parallel.tp_size`/`tp_rank`: vLLM's tensor parallel group (attention's TP);
- `parallel.dp_size`/`dp_rank`: vLLM's data parallel group;
- `parallel.pp_size`/`pp_rank`: vLLM's pipeline group (a draft is built on the last stage);
- `parallel.ep_size`/`ep_rank`: the expert-parallel group vLLM's fused-MoE layer computes
  (`FusedMoEParallelConfig.make`: with --enable-expert-parallel the experts are split over the
  flattened dp x pcp x tp ranks and the MoE's own TP is 1; without it ep_size is 1);
- `runtime.a2a_backend`: `ParallelConfig.all2all_backend` of the model's own ParallelConfig (what its
  MoE layers build with), spelled as vLLM spells it.

The default deployment id is the served model's: a draft's is its target's (`Served`).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping

from ...plan import ENGINE_VLLM, ROLE_SPECULATIVE, ROLE_TARGET, Parallel, ResolveRequest, Runtime


@dataclass(frozen=True)
class Served:
    """What names the deployment a runner belongs to: the model vLLM serves and that model's layout.
    For a draft it is the target's (its own model, layout and all2all backend differ)."""
    model: str
    tp_size: int = 1
    ep_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    a2a_backend: str = "allgather_reducescatter"


@dataclass(frozen=True)
class WorkerIdentity:
    model: str                        # the checkpoint vLLM loads (path or hub name)
    config: Mapping[str, Any]         # its config.json, architectures as vLLM builds them
    role: str = ROLE_TARGET
    parallel: Parallel = field(default_factory=Parallel)
    device: str = "cpu"
    a2a_backend: str = "allgather_reducescatter"
    quantization: str | None = None   # online quantization vLLM applies to an unquantized checkpoint
    enable_eplb: bool = False
    ep_num_redundant_experts: int = 0
    engine_version: str = ""
    served: Served | None = None      # the deployment's model and layout; None: this runner's own
    # vLLM's own config values and VLLM_* switches the vllm profile reads (loadplan/engine_inputs.py), as text
    engine_args: Mapping[str, str] = field(default_factory=dict)
    engine_env: Mapping[str, str] = field(default_factory=dict)


def served_by(identity: WorkerIdentity) -> Served:
    if identity.served is not None:
        return identity.served
    p = identity.parallel
    return Served(model=identity.model, tp_size=p.tp_size, ep_size=p.ep_size, pp_size=p.pp_size, dp_size=p.dp_size,
                  a2a_backend=identity.a2a_backend)


def default_deployment(identity: WorkerIdentity) -> str:
    """A deployment id every rank of one vLLM deployment computes alike, its draft's ranks included:
    the served model and its layout.

    Set $LOADPLAN_DEPLOYMENT to name the deployment instead; two deployments of one model with
    one layout then stay apart in the history."""
    s = served_by(identity)
    key = json.dumps([s.model, s.tp_size, s.ep_size, s.pp_size, s.dp_size, s.a2a_backend, identity.device],
                     separators=(",", ":"))
    return f"vllm-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def resolve_request(identity: WorkerIdentity, deployment: str | None = None, upgrade_from: str = "") -> ResolveRequest:
    """The request this runner sends at its instantiation point (a fresh request id per start)."""
    config = dict(identity.config)
    qconfig = config.get("quantization_config")
    return ResolveRequest(
        request_id=uuid.uuid4().hex,
        deployment_id=deployment or default_deployment(identity),
        role=identity.role,
        parallel=identity.parallel,
        host=socket.gethostname()[:255],
        config=config,
        quantization_config=qconfig if isinstance(qconfig, dict) else None,
        quantization=identity.quantization,
        runtime=Runtime(a2a_backend=identity.a2a_backend, device=identity.device, engine=ENGINE_VLLM,
                        engine_version=identity.engine_version, enable_eplb=identity.enable_eplb,
                        ep_num_redundant_experts=identity.ep_num_redundant_experts if identity.enable_eplb else 0,
                        engine_args=identity.engine_args, engine_env=identity.engine_env,
                        upgrade_from=upgrade_from),
    )


# --- reading vLLM (imported inside the worker only) -------------------------------------------

def identity_of(vllm_config, model_config) -> WorkerIdentity:
    """The identity of the runner about to build `model_config` under `vllm_config` (in a worker,
    after vLLM's distributed groups exist)."""
    import vllm
    from vllm.distributed import get_pp_group, get_tp_group

    from .built import moe_parallel_config

    pc = vllm_config.parallel_config          # the model's own: a draft's is vLLM's draft ParallelConfig
    moe = moe_parallel_config(pc)             # the groups' sizes, with this model's EP and backend
    draft = vllm_config.speculative_config
    role = ROLE_SPECULATIVE if draft is not None and model_config is draft.draft_model_config else ROLE_TARGET
    config = checkpoint_config(model_config)
    has_own_quantization = isinstance(config.get("quantization_config"), dict)
    tp, pp = get_tp_group(), get_pp_group()
    served = None
    if role == ROLE_SPECULATIVE:              # the deployment is the target's: its model and layout
        target_pc = draft.target_parallel_config
        served = Served(model=str(draft.target_model_config.model), tp_size=target_pc.tensor_parallel_size,
                        ep_size=moe_parallel_config(target_pc).ep_size,
                        pp_size=target_pc.pipeline_parallel_size, dp_size=target_pc.data_parallel_size,
                        a2a_backend=target_pc.all2all_backend)
    return WorkerIdentity(
        model=str(model_config.model),
        config=config,
        role=role,
        parallel=Parallel(tp_size=tp.world_size, tp_rank=tp.rank_in_group, ep_size=moe.ep_size, ep_rank=moe.ep_rank,
                          pp_size=pp.world_size, pp_rank=pp.rank_in_group, dp_size=moe.dp_size, dp_rank=moe.dp_rank),
        served=served,
        device=device_of(),
        a2a_backend=pc.all2all_backend,
        quantization=None if has_own_quantization else model_config.quantization,
        enable_eplb=pc.enable_eplb,
        ep_num_redundant_experts=pc.eplb_config.num_redundant_experts,
        engine_version=str(vllm.__version__).split("+")[0],
        **engine_inputs_of(pc),
    )


# The ParallelConfig fields sent as they are (the sizes come from the worker's groups: a draft's ParallelConfig is
# vLLM's own for the draft, whose sizes are not its groups').
SENT_ARGS = ("all2all_backend", "enable_eplb")


def engine_inputs_of(parallel_config, environ=os.environ) -> dict[str, dict[str, str]]:
    """What the vllm profile reads (loadplan/engine_inputs.py) of this worker's ParallelConfig and environment."""
    from ...engine_inputs import names

    args = {n: str(getattr(parallel_config, n)) for n in names(ENGINE_VLLM, "arg")
            if n in SENT_ARGS and hasattr(parallel_config, n)}
    return {"engine_args": args, "engine_env": {n: environ[n] for n in names(ENGINE_VLLM, "env") if n in environ}}


def checkpoint_config(model_config) -> dict[str, Any]:
    """The checkpoint's config.json (a local folder or the hub's file, as vLLM reads it), with the
    architectures vLLM builds: a draft vLLM rewrites (an MTP head) is asked about as built."""
    from vllm.transformers_utils.repo_utils import get_hf_file_to_dict

    config = get_hf_file_to_dict("config.json", model_config.model, model_config.revision)
    if not isinstance(config, dict):       # a checkpoint without config.json: what vLLM parsed
        config = json.loads(model_config.hf_config.to_json_string(use_diff=False))
    architectures = list(model_config.architectures or [])
    if architectures and architectures != config.get("architectures"):
        config = {**config, "architectures": architectures}
    return config


def device_of() -> str:
    """The registry's device spelling of vLLM's platform: cpu, cuda:MAJOR.MINOR, hip:MAJOR.MINOR."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "cpu"
    kind = "hip" if current_platform.is_rocm() else "cuda" if current_platform.is_cuda() else None
    capability = current_platform.get_device_capability()
    if kind is None or capability is None:
        raise RuntimeError(f"loadplan: vLLM platform {current_platform.device_type!r} has no registry device "
                           f"(cpu, cuda or hip)")
    return f"{kind}:{capability.major}.{capability.minor}"
