"""vLLM's own answers to the questions the registry's `vllm` profile answers: run in the vLLM env.

    <vllm env>/bin/python vllm_decisions.py  ->  one JSON document on the last stdout line

For every all2all backend the installed vLLM release accepts, over tp/dp sizes with and without
--enable-expert-parallel: vLLM's `ParallelConfig` (which rewrites removed backends), its
`FusedMoEParallelConfig.make` (worker groups faked: rank 0 of each), the prepare/finalize class
vLLM makes (loadplan.integrations.vllm.built, which restates maybe_make_prepare_finalize's
branches; tests/integrations/vllm pins that to the source) and that class's own
`output_is_reduced()`; where the class cannot be imported on a CPU (its communication library is
missing), the constant its source returns. Then `resolve_layer_fused_shared_expert` on this CPU,
and `get_pp_indices` over a few layer counts.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import typing


def main() -> None:
    from vllm.config import ParallelConfig
    from vllm.config.parallel import All2AllBackend
    from vllm.distributed.utils import get_pp_indices
    from vllm.model_executor.layers.fused_moe import config as moe_config_module
    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig
    from vllm.model_executor.layers.fused_moe.utils import resolve_layer_fused_shared_expert

    from loadplan.integrations.vllm import built

    class RankZero:       # the worker's process groups, as make() reads them: rank 0 of each
        rank_in_group = 0

    moe_config_module.get_dp_group = RankZero
    moe_config_module.get_pcp_group = RankZero
    moe_config_module.get_tensor_model_parallel_rank = lambda: 0

    cases = []
    for backend in typing.get_args(All2AllBackend):
        for tp, dp in ((1, 1), (2, 1), (1, 2), (2, 2)):
            for ep in (False, True):
                pc = ParallelConfig(tensor_parallel_size=tp, data_parallel_size=dp, enable_expert_parallel=ep,
                                    all2all_backend=backend)
                moe = FusedMoEParallelConfig.make(tp_size_=tp, pcp_size_=1, dp_size_=dp, sp_size_=1,
                                                  vllm_parallel_config=pc)
                try:
                    cls = built.prepare_finalize_class(moe)
                    reduced = built.output_is_reduced(cls)
                    name, how = getattr(cls, "__name__", None), "called"
                except built.NotBuildableHere:
                    module, name = next((m, n) for p, m, n in built.PREPARE_FINALIZE if getattr(moe, p))
                    reduced, how = source_constant(f"{built.FUSED_MOE}.{module}", name), "source"
                cases.append(dict(backend=backend, vllm_backend=pc.all2all_backend, tp=tp, dp=dp, ep=ep,
                                  moe_tp_size=moe.tp_size, moe_ep_size=moe.ep_size, moe_ep_rank=moe.ep_rank,
                                  use_all2all_kernels=moe.use_all2all_kernels, prepare_finalize=name,
                                  output_is_reduced=reduced, output_is_reduced_from=how,
                                  forward_path=built.forward_path(moe),
                                  post_experts_all_reduce=built.post_experts_all_reduce(moe, reduced)))
    fused = bool(resolve_layer_fused_shared_expert(None, "model.layers.1.mlp"))
    pp = {f"{n}/{size}": [list(get_pp_indices(n, r, size)) for r in range(size)]
          for n in (3, 5, 6, 7, 61) for size in (2, 3, 4) if size <= n}
    import vllm

    print(json.dumps({"version": str(vllm.__version__).split("+")[0], "cases": cases,
                      "cpu_fused_shared_expert": fused, "pp": pp}))


def source_constant(module: str, cls: str) -> bool:
    """What `cls.output_is_reduced` returns in `module`'s source: a single `return True/False`."""
    origin = importlib.util.find_spec(module).origin
    tree = ast.parse(open(origin).read())
    [klass] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
    [method] = [n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == "output_is_reduced"]
    [ret] = [n for n in ast.walk(method) if isinstance(n, ast.Return)]
    assert isinstance(ret.value, ast.Constant) and isinstance(ret.value.value, bool), ast.dump(ret)
    return ret.value.value


if __name__ == "__main__":
    main()
