"""SGLang 0.5.23's own load-time decisions for grid points: the conformance oracle.

Run under the SGLang environment's python (`.venv-sglang`), one process per device:

    .venv-sglang/bin/python tests/conformance/sglang_oracle.py --device cuda:9.0 < points.jsonl

Each input line is a grid point (JSON); each output line is SGLang's answer for it, in
order, as JSON: `{"point": ..., "answer": ...}`. For every point the decision is SGLang's
own code, run as its scheduler runs it (DESIGN 8.4):

- `ServerArgs(...)` then `publish(server_args, role="scheduler", ranks=...)`: the whole
  server-args resolution pipeline, with its input rewrites and its start-up refusals;
- `initialize_moe_config()` (the scheduler's MoE flags; refuses SBO on SM90);
- `ModelConfig.from_server_args`, `get_model_architecture`, the loader's
  `_get_quantization_config` (refuses a quantization the device cannot run);
- the loader's shared-experts step (`loader_fusion`: `resolve_shared_experts_config` in 0.5.23,
  `install_shared_experts_fusion_decision` and the model's own count before it), for a draft inside
  `draft_model_build_scope()`;
- for a draft, what its weight loader checks of the config before it reads a tensor (`nextn_load_check`: one MTP
  layer);
- the family MoE block's own `forward`, run on a stand-in `self` whose branch methods
  record which one was taken; the attributes that select the branch are SGLang's own
  `__init__` expressions, evaluated (FAMILY_BLOCKS says which block a class builds);
- `post_experts_output_is_complete(...)` and the MoE widths: whether a reduction is still
  owed after the experts on the branch taken;
- `get_pp_indices(...)` per stage, and the decoder's own `_is_layer_sparse` for EPLB layers
  (the model runner gives a draft worker no EPLB manager: `not self.is_draft_worker`).

Answer fields: `refused` (+ `stage`, `message`: SGLang's own refusal), `rewritten` (the
server args resolution left: tp/ep/moe-tp/attention-DP sizes, a2a and runner backends,
the fusion flags), `shared_experts_fusion`, `num_fused_shared_experts`, `fusion_reason`
(the gate's reason), `block`/`branch` (the MoE block and the forward branch it took),
`dispatcher` (what its experts layer builds), `combine_complete`, `forward_path` (`a2a`
when tokens are dispatched and combined: the dispatch branch, or an all-to-all
dispatcher or complete combine inside the experts layer under the normal branch),
`post_experts_all_reduce` (a reduction still owed after the experts on that branch),
`pp_layer_ranges` (per stage; none for a draft), `eplb_enabled`, `eplb_layers` (per stage),
`config_architectures` (what SGLang's ModelConfig made of the config).

What is emulated, not SGLang's: the device (tests/conformance/sglang_cpu.py), and the
experts layer's dispatcher, which is taken from SGLang's `create_moe_dispatcher` run with
its dispatcher classes replaced by their names.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import importlib
import importlib.util
import inspect
import json
import logging
import os
import re
import sys
import textwrap
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import sglang_cpu  # noqa: E402

CONFIG_DIRS = (ROOT / "tests" / "data" / "configs", HERE / "configs")

# The MoE block each entry class builds (module, class): the class whose forward picks
# the dispatch or the partial-sum branch. A wrapper builds its inner family's block.
FAMILY_BLOCKS = {
    "DeepseekV2ForCausalLM": ("sglang.srt.models.deepseek_v2", "DeepseekV2MoE"),
    "DeepseekV3ForCausalLM": ("sglang.srt.models.deepseek_v2", "DeepseekV2MoE"),
    "DeepseekV3ForCausalLMNextN": ("sglang.srt.models.deepseek_v2", "DeepseekV2MoE"),
    "DeepseekV32ForCausalLM": ("sglang.srt.models.deepseek_v2", "DeepseekV2MoE"),
    "KimiK25ForConditionalGeneration": ("sglang.srt.models.deepseek_v2", "DeepseekV2MoE"),
    "KimiVLForConditionalGeneration": ("sglang.srt.models.deepseek_v2", "DeepseekV2MoE"),
    "Glm4MoeForCausalLM": ("sglang.srt.models.glm4_moe", "Glm4MoeSparseMoeBlock"),
    "Glm4MoeForCausalLMNextN": ("sglang.srt.models.glm4_moe", "Glm4MoeSparseMoeBlock"),
    "Glm4vMoeForConditionalGeneration": ("sglang.srt.models.glm4_moe", "Glm4MoeSparseMoeBlock"),
    "Glm4MoeLiteForCausalLM": ("sglang.srt.models.glm4_moe_lite", "Glm4MoeLiteSparseMoeBlock"),
    "Glm4MoeLiteForCausalLMNextN": ("sglang.srt.models.glm4_moe_lite", "Glm4MoeLiteSparseMoeBlock"),
    "MiniMaxM2ForCausalLM": ("sglang.srt.models.minimax_m2", "MiniMaxM2MoE"),
    "ExaoneMoeForCausalLM": ("sglang.srt.models.exaone_moe", "ExaoneMoESparseMoEBlock"),
    "MiMoV2FlashForCausalLM": ("sglang.srt.models.mimo_v2", "MiMoV2MoE"),
    "Step3p5ForCausalLM": ("sglang.srt.models.step3p5", "Step3p5MoEMLP"),
    "Step3p7ForConditionalGeneration": ("sglang.srt.models.step3p5", "Step3p5MoEMLP"),   # step3p7.py: its text model
    "DbrxForCausalLM": ("sglang.srt.models.dbrx", "DbrxExperts"),
    "NemotronHForCausalLM": ("sglang.srt.models.nemotron_h", "NemotronHMoE"),
    "GlmMoeDsaForCausalLM": ("sglang.srt.models.deepseek_v2", "DeepseekV2MoE"),
    "AfmoeForCausalLM": ("sglang.srt.models.afmoe", "AfmoeMoE"),
    "Cohere2MoeForCausalLM": ("sglang.srt.models.cohere2_moe", "Cohere2MoeSparseMoeBlock"),
    "Ernie4_5_MoeForCausalLM": ("sglang.srt.models.ernie4", "Ernie4Moe"),
    # granitemoehybrid.py builds granitemoe.py's block
    **{name: ("sglang.srt.models.granitemoe", "GraniteMoeMoE")
       for name in ("GraniteMoeForCausalLM", "GraniteMoeSWAForCausalLM", "GraniteMoeSharedForCausalLM",
                    "GraniteMoeHybridForCausalLM")},
    "HYV3ForCausalLM": ("sglang.srt.models.hunyuan_v3", "HYV3MoEFused"),
    "HunYuanMoEV1ForCausalLM": ("sglang.srt.models.hunyuan", "HunYuanSparseMoeBlock"),
    "KimiLinearForCausalLM": ("sglang.srt.models.kimi_linear", "KimiMoE"),
    "LagunaForCausalLM": ("sglang.srt.models.laguna", "LagunaMoE"),
    "Lfm2MoeForCausalLM": ("sglang.srt.models.lfm2_moe", "Lfm2MoeSparseMoeBlock"),
    "Llama4ForCausalLM": ("sglang.srt.models.llama4", "Llama4MoE"),
    "LongcatFlashForCausalLM": ("sglang.srt.models.longcat_flash", "LongcatFlashMoE"),
    # mellum.py builds qwen3_moe.py's block
    "MellumForCausalLM": ("sglang.srt.models.qwen3_moe", "Qwen3MoeSparseMoeBlock"),
    "OlmoeForCausalLM": ("sglang.srt.models.olmoe", "OlmoeMoE"),
    "GptOssForCausalLM": ("sglang.srt.models.gpt_oss", "GptOssSparseMoeBlock"),
    "MixtralForCausalLM": ("sglang.srt.models.mixtral", "MixtralMoE"),
    "Qwen2MoeForCausalLM": ("sglang.srt.models.qwen2_moe", "Qwen2MoeSparseMoeBlock"),
    "Qwen3MoeForCausalLM": ("sglang.srt.models.qwen3_moe", "Qwen3MoeSparseMoeBlock"),
    # deepseek_v4.py and deepseek_ocr.py build deepseek_v2.DeepseekV2MoE; dots3.py's Dots3NoteForCausalLM its Dots3MoE
    "DeepseekV4ForCausalLM": ("sglang.srt.models.deepseek_v2", "DeepseekV2MoE"),
    "DeepseekOCRForCausalLM": ("sglang.srt.models.deepseek_v2", "DeepseekV2MoE"),
    "Dots3NoteForCausalLM": ("sglang.srt.models.dots3_common.modeling", "Dots3MoE"),
    # minimax_m3.py: MiniMaxM3DecoderLayer builds MiniMaxM3MoE on its sparse layers; mistral_large_3.py subclasses
    # DeepseekV3ForCausalLM, and pixtral.py builds it from a text_config whose model_type is deepseek_v3
    "MiniMaxM3SparseForCausalLM": ("sglang.srt.models.minimax_m3", "MiniMaxM3MoE"),
    "MistralLarge3ForCausalLM": ("sglang.srt.models.deepseek_v2", "DeepseekV2MoE"),
    "PixtralForConditionalGeneration": ("sglang.srt.models.deepseek_v2", "DeepseekV2MoE"),
    # qwen3_next.py (and its MTP subclass), qwen3_5.py (and the MiniCPM-V 4.6 / 4.7 text models it builds) build the
    # Qwen2-MoE block on their MoE layers
    **{name: ("sglang.srt.models.qwen2_moe", "Qwen2MoeSparseMoeBlock")
       for name in ("Qwen3NextForCausalLM", "Qwen3NextForCausalLMMTP", "Qwen3_5MoeForCausalLM",
                    "Qwen3_5MoeForConditionalGeneration", "MiniCPMV4_6ForConditionalGeneration",
                    "MiniCPMV4_7ForConditionalGeneration")},
}

# Entry classes whose MoE block decides its own shared-expert fusion while it is built, outside
# resolve_shared_experts_config: the Qwen2-MoE block, with the fusion flags the named module's decoder
# layers pass it (its `Qwen2MoeSparseMoeBlock(...)` calls). See `block_fusion`.
BLOCK_FUSION = {
    "Qwen3NextForCausalLM": "sglang.srt.models.qwen3_next",
    "Qwen3NextForCausalLMMTP": "sglang.srt.models.qwen3_next",
    "Qwen3_5MoeForCausalLM": "sglang.srt.models.qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "sglang.srt.models.qwen3_5",
    "MiniCPMV4_6ForConditionalGeneration": "sglang.srt.models.qwen3_5",
    "MiniCPMV4_7ForConditionalGeneration": "sglang.srt.models.qwen3_5",
}
BLOCK_FUSION_FLAGS = ("support_shared_expert_fusion", "enable_cuda_shared_expert_fusion")

# Decoder-layer classes whose `_is_layer_sparse(config, layer_id, is_nextn=...)` says
# which layers hold routed experts (the EPLB layers).
SPARSE_PREDICATES = {
    "sglang.srt.models.deepseek_v2": "DeepseekV2DecoderLayer",
    "sglang.srt.models.glm4_moe": "Glm4MoeDecoderLayer",
}

# The block methods that are whole forward branches (helpers such as
# `_forward_shared_experts` run inside a branch and are not one).
BRANCH_METHOD = re.compile(r"^_?forward_(normal|deepep|mega|dwdp|cpu|fuseep|a2a)")
DISPATCH_BRANCH_WORDS = ("deepep", "a2a", "mega", "fuseep")

# Per-rank dispatch-token budgets, set as an operator running these backends sets them.
# At SGLang's defaults (128 for pplx and DeepEP v2, 4096 for MoRI) resolution refuses
# every point of those backends for the default chunked-prefill size: a buffer-size
# check the registry cannot see (it is not a layout decision), which would hide what
# SGLang decides about the layout there.
DISPATCH_BUDGETS = {
    "SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK": "16384",
    "SGLANG_PPLX_NUM_MAX_DISPATCH_TOKENS_PER_RANK": "16384",
    "SGLANG_DEEPEP_V2_NUM_MAX_DISPATCH_TOKENS_PER_RANK": "16384",
}


def config_dir(name: str) -> Path:
    for base in CONFIG_DIRS:
        if (base / name / "config.json").is_file():
            return base / name
    raise ValueError(f"config: no config dir {name!r} under {[str(b) for b in CONFIG_DIRS]}")


class _Branch(Exception):
    def __init__(self, name):
        super().__init__(name)
        self.name = name


class _BlockStandIn:
    """`self` for a MoE block's forward: branch methods record themselves, the branch
    attributes are SGLang's own __init__ expressions, anything else is an inert stub."""

    def __init__(self, cls, attrs):
        object.__setattr__(self, "_cls", cls)
        object.__setattr__(self, "_attrs", attrs)

    def __getattr__(self, name):
        attrs = object.__getattribute__(self, "_attrs")
        if name in attrs:
            return attrs[name]
        cls = object.__getattribute__(self, "_cls")
        if BRANCH_METHOD.match(name) and callable(getattr(cls, name, None)):
            def branch(*a, **k):
                raise _Branch(name)
            return branch
        return sglang_cpu._Anything(f"self.{name}")

    def __setattr__(self, name, value):
        object.__getattribute__(self, "_attrs")[name] = value


@functools.lru_cache(maxsize=None)
def _branch_selectors(cls) -> tuple:
    """The `self.X = <expr>` lines of cls.__init__ whose expression reads the a2a backend."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        target = node.targets[0]
        if not (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                and target.value.id == "self"):
            continue
        text = ast.unparse(node.value)
        if "a2a_backend" in text or "deepep" in text:
            found.append((target.attr, compile(ast.Expression(node.value), f"<{cls.__name__}.__init__>", "eval")))
    return tuple(found)


def _init_branch_attrs(cls, module, hf_config, quant_config) -> dict:
    """Evaluate SGLang's own branch-selecting __init__ expressions for this runner."""
    attrs: dict = {}
    stand_in = _BlockStandIn(cls, attrs)
    for name, code in _branch_selectors(cls):
        try:
            value = eval(code, vars(module), {"self": stand_in, "config": hf_config,
                                              "quant_config": quant_config})
        except Exception:  # an expression needing the real layer: not a branch selector
            continue
        if isinstance(value, bool):
            attrs[name] = value
    return attrs


def forward_branch(entry_class, hf_config, quant_config) -> dict:
    """Run the family block's forward on a stand-in; return the branch it takes."""
    import torch

    where = FAMILY_BLOCKS.get(entry_class)
    if where is None:
        return {"block": None, "branch": None}
    module = importlib.import_module(where[0])
    cls = getattr(module, where[1])
    text = getattr(hf_config, "text_config", None) or hf_config
    attrs = _init_branch_attrs(cls, module, text, quant_config)
    attrs.setdefault("num_fused_shared_experts", 0)
    stand_in = _BlockStandIn(cls, attrs)
    hidden = torch.zeros(1, 8)
    try:
        cls.forward(stand_in, hidden, None)
    except _Branch as taken:
        branch = taken.name
    except NotImplementedError as e:
        branch = f"not_implemented: {e}"
    except Exception as e:  # the inline body reached the (stub) experts and broke there
        branch = "inline"
        _ = e
    else:
        branch = "inline"
    return {"block": f"{where[1]}", "branch": branch, "branch_attrs": attrs}


def _block_fusion_flags(builder) -> dict:
    """The fusion keywords (source expressions) of the `Qwen2MoeSparseMoeBlock(...)` calls in `builder`'s source:
    one set, whichever decoder layer builds the block."""
    found = set()
    for node in ast.walk(ast.parse(inspect.getsource(builder))):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Qwen2MoeSparseMoeBlock":
            found.add(tuple(sorted((k.arg, ast.unparse(k.value)) for k in node.keywords
                                   if k.arg in BLOCK_FUSION_FLAGS)))
    if len(found) != 1:
        raise RuntimeError(f"{builder.__name__} builds Qwen2MoeSparseMoeBlock with {len(found)} sets of fusion flags")
    return dict(found.pop())


def _statements(fn, first: str, last: str) -> list:
    """The top-level statements of `fn`'s body from the one whose source holds `first` to the one holding `last`."""
    body = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0].body
    texts = [ast.unparse(stmt) for stmt in body]
    start = next(i for i, t in enumerate(texts) if first in t)
    end = next(i for i, t in enumerate(texts) if i >= start and last in t)
    return body[start:end + 1]


def block_fusion(model_class, hf_config, quant_config) -> int | None:
    """`num_fused_shared_experts` as the Qwen2-MoE block's own __init__ sets it (None: a class whose block does not
    decide it). The flags are the builder's call expressions, evaluated in its module; the decision is the block's
    statements from `self.num_shared_experts` to `self.num_fused_shared_experts`, run on a stand-in `self`; then the
    entry class's own refusal of the count (qwen3_next.py: more than one fused shared expert), where it has one."""
    import types

    where = BLOCK_FUSION.get(model_class.__name__)
    if where is None:
        return None
    builder = importlib.import_module(where)
    module_name, block_name = FAMILY_BLOCKS[model_class.__name__]
    block_module = importlib.import_module(module_name)
    flags = {name: eval(expr, vars(builder)) for name, expr in _block_fusion_flags(builder).items()}
    block = getattr(block_module, block_name)
    stand_in = types.SimpleNamespace()
    local = {"self": stand_in, "config": getattr(hf_config, "text_config", None) or hf_config,
             "quant_config": quant_config, **dict.fromkeys(BLOCK_FUSION_FLAGS, False), **flags}
    code = ast.Module(body=_statements(block.__init__, "self.num_shared_experts =", "self.num_fused_shared_experts = "
                                       "self.num_shared_experts"), type_ignores=[])
    exec(compile(code, f"<{block.__name__}.__init__>", "exec"), vars(block_module), local)
    for cls in model_class.__mro__:
        init = vars(cls).get("__init__")
        if inspect.isfunction(init) and "self.num_fused_shared_experts > 1" in inspect.getsource(init):
            check = ast.Module(body=_statements(init, "self.num_fused_shared_experts > 1",
                                                "self.num_fused_shared_experts > 1"), type_ignores=[])
            exec(compile(check, f"<{cls.__name__}.__init__>", "exec"), vars(importlib.import_module(cls.__module__)),
                 {"self": stand_in})
            break
    return int(stand_in.num_fused_shared_experts)


def loader_fusion(moe_utils, model_class, hf_config, quant_config):
    """The loader's shared-experts step, as this release names it: (fusion disabled, fused shared experts, a
    context in which the model builds under that decision).
    - 0.5.23: `resolve_shared_experts_config(model_class, hf_config, quant_config)` answers both;
    - 0.5.18-0.5.22: `install_shared_experts_fusion_decision(...)` installs the flag, and the model class counts
      its fused experts from it as it builds (`determine_num_fused_shared_experts`, run on a stand-in `self`
      holding the config; a class without one fuses none)."""
    import types

    from sglang.srt.runtime_context import get_model

    if hasattr(moe_utils, "resolve_shared_experts_config"):
        shared = moe_utils.resolve_shared_experts_config(model_class, hf_config, quant_config)
        return (bool(shared.fusion_disabled), int(shared.num_fused_shared_experts),
                lambda: get_model().override(shared_experts=shared))
    moe_utils.install_shared_experts_fusion_decision(model_class, hf_config, quant_config)
    disabled = bool(moe_utils.is_shared_experts_fusion_disabled())
    builder, config = model_class, hf_config
    inner = WRAPPER_BUILDS.get(model_class.__name__)
    if inner is not None:       # the wrapper's language model counts them, from its text config
        config = getattr(hf_config, "text_config", None) or hf_config
        module, name = inner(config)
        builder = getattr(importlib.import_module(module), name)
    count = getattr(builder, "determine_num_fused_shared_experts", None)
    fused = 0
    if count is not None:
        stand_in = types.SimpleNamespace(config=config, num_fused_shared_experts=0, quant_config=quant_config)
        count(stand_in)
        fused = int(stand_in.num_fused_shared_experts or 0)
    return disabled, fused, contextlib.nullcontext


def _deepseek(name: str):
    return lambda text: ("sglang.srt.models.deepseek_v2", name)


# Before 0.5.23: the wrappers whose language model counts its fused shared experts (their gates delegate to it),
# and which class they build for a text config (models/kimi_k25.py, kimi_vl.py, pixtral.py, deepseek_ocr.py,
# dots3_common/modeling.py). A class that fuses none (DeepseekForCausalLM, Mistral's GQA model) is named too.
WRAPPER_BUILDS = {
    "KimiK25ForConditionalGeneration": _deepseek("DeepseekV3ForCausalLM"),
    "KimiVLForConditionalGeneration": _deepseek("DeepseekV2ForCausalLM"),
    "PixtralForConditionalGeneration": lambda text: (
        ("sglang.srt.models.mistral_large_3", "MistralLarge3ForCausalLM")
        if getattr(text, "model_type", "") == "deepseek_v3" else ("sglang.srt.models.deepseek", "DeepseekForCausalLM")),
    "DeepseekOCRForCausalLM": lambda text: (
        _deepseek("DeepseekV3ForCausalLM")(text) if getattr(text, "topk_method", None) == "noaux_tc"
        else ("sglang.srt.models.deepseek", "DeepseekForCausalLM") if not getattr(text, "use_mla", False)
        else _deepseek("DeepseekV2ForCausalLM")(text)),
    "Dots3NoteForCausalLM": lambda text: ("sglang.srt.models.dots3_common.modeling", "Dots3LanguageModelForCausalLM"),
}


NEXTN_LOAD_CHECK = "nextn layer is supported"


def nextn_load_check(model_class, hf_config) -> None:
    """What a NextN draft's weight loader checks of the config before it reads a tensor: the DeepSeek mixin's
    `_initialize_nextn_conf(is_nextn=True)`, or the `if is_nextn:` statement of a `load_weights` that asserts one
    MTP layer (glm4_moe.py, glm4_moe_lite.py), run on a stand-in `self` holding the draft's config. Raises as SGLang
    raises."""
    import types

    stand_in = types.SimpleNamespace(config=hf_config)
    if hasattr(model_class, "_initialize_nextn_conf"):
        model_class._initialize_nextn_conf(stand_in, True)
        return
    for cls in model_class.__mro__:
        load = vars(cls).get("load_weights")
        if inspect.isfunction(load) and NEXTN_LOAD_CHECK in inspect.getsource(load):
            check = ast.Module(body=_statements(load, "if is_nextn:", "if is_nextn:"), type_ignores=[])
            exec(compile(check, f"<{cls.__name__}.load_weights>", "exec"),
                 vars(importlib.import_module(cls.__module__)), {"self": stand_in, "is_nextn": True})
            return


def experts_dispatcher() -> str:
    """The dispatcher SGLang's experts layer builds for the published a2a backend."""
    layer = importlib.import_module("sglang.srt.layers.moe.fused_moe_triton.layer")
    names = ("StandardDispatcher", "MaybeTboDeepEPDispatcher", "DeepEPv2Dispatcher",
             "FlashinferDispatcher", "AscendTPDispatcher")
    saved = {n: getattr(layer, n) for n in names if hasattr(layer, n)}
    saved_extra = {n: getattr(layer, n) for n in ("get_parallel", "_get_deepep_comm_group", "get_tp_group",
                                                   "get_deepep_v2_dispatcher_output_dtype",
                                                   "_deepep_v2_experts_are_fp8", "get_deepep_mode")
                   if hasattr(layer, n)}
    try:
        for n in saved:
            setattr(layer, n, (lambda name: (lambda *a, **k: name))(n))
        for n in saved_extra:
            setattr(layer, n, lambda *a, **k: sglang_cpu._Anything(n))
        args = [sglang_cpu._Anything("moe_runner_config"), sglang_cpu._Anything("quant_method")]
        # 0.5.20 takes the runner config alone
        return layer.create_moe_dispatcher(*args[:len(inspect.signature(layer.create_moe_dispatcher).parameters)])
    except NotImplementedError as e:
        return f"unsupported: {e}"
    finally:
        for n, v in {**saved, **saved_extra}.items():
            setattr(layer, n, v)


A2A_DISPATCHERS = {"MaybeTboDeepEPDispatcher", "DeepEPv2Dispatcher", "FlashinferDispatcher"}


def server_args_for(point: dict, model_dir: Path):
    from sglang.srt.server_args import ServerArgs

    tp, ep, dp = point["tp"], point["ep"], point.get("dp", 1)
    kwargs = dict(
        model_path=str(model_dir),
        skip_tokenizer_init=True,
        load_format="dummy",
        tp_size=tp * ep,                 # SGLang's tp is the whole group (DESIGN 8.1)
        ep_size=ep,
        pp_size=point.get("pp", 1),
        moe_a2a_backend=point.get("a2a_backend", "none"),
        moe_runner_backend=point.get("moe_runner_backend") or "auto",
        disable_shared_experts_fusion=bool(point.get("disable_fusion")),
        enforce_shared_experts_fusion=bool(point.get("enforce_fusion")),
        enable_single_batch_overlap=bool(point.get("sbo")),
        enable_two_batch_overlap=bool(point.get("tbo")),
        enable_eplb=bool(point.get("eplb")),
    )
    if dp > 1:
        kwargs.update(dp_size=dp, enable_dp_attention=True)
    if point.get("quantization"):
        kwargs["quantization"] = point["quantization"]
    if point.get("draft_config"):
        # A draft of the target's own checkpoint is its NextN/MTP layer; another
        # checkpoint is a standalone draft model.
        algorithm = "NEXTN" if point["draft_config"] == point["config"] else "STANDALONE"
        kwargs.update(speculative_algorithm=algorithm,
                      speculative_draft_model_path=str(config_dir(point["draft_config"])),
                      speculative_num_steps=1, speculative_eagle_topk=1,
                      speculative_num_draft_tokens=2)
    return ServerArgs(**kwargs)


def _raised_here(e: BaseException) -> bool:
    """Whether the exception comes from this oracle's own code (a SGLang function a release does not have, called
    the wrong way) rather than from SGLang's."""
    frames = traceback.extract_tb(e.__traceback__)
    return bool(frames) and Path(frames[-1].filename).name in (Path(__file__).name, "sglang_cpu.py")


def _message(e: BaseException) -> str:
    text = str(e).strip()
    if not text:   # a bare assert: name the SGLang line that refused
        frame = traceback.extract_tb(e.__traceback__)[-1]
        text = f"{Path(frame.filename).name}:{frame.lineno}: {frame.line}"
    return f"{type(e).__name__}: {text}"[:600]


def answer(point: dict) -> dict:
    """SGLang's decisions for one grid point (the point's device must be this process's)."""
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.utils import get_pp_indices
    from sglang.srt.layers.moe import utils as moe_utils
    from sglang.srt.model_loader.loader import _get_quantization_config
    from sglang.srt.model_loader.utils import get_model_architecture
    from sglang.srt import runtime_context
    from sglang.srt.runtime_context import (get_exec, get_parallel, publish,
                                            reset_context)

    draft = bool(point.get("draft_config"))
    known: dict = {}     # what a refusal after the model config still tells (the architectures it gave a draft)
    started = time.perf_counter()
    stage = "server_args"
    try:
        model_dir = config_dir(point["config"])
        server_args = server_args_for(point, model_dir)
        reset_context()
        if hasattr(runtime_context, "SpawnRanks"):     # 0.5.21 and later publish the scheduler's ranks
            publish(server_args, role="scheduler", ranks=runtime_context.SpawnRanks(world_rank=0, gpu_id=0))
        else:
            publish(server_args, role="scheduler")
        stage = "moe_config"
        moe_utils.initialize_moe_config()
        exec_moe = get_exec().moe
        parallel = get_parallel()
        rewritten = {
            "tp_size": parallel.tp_size,
            "ep_size": parallel.moe_ep_size,
            "moe_tp_size": parallel.moe_tp_size,
            "attn_dp_size": parallel.attn_dp_size,
            "moe_a2a_backend": str(exec_moe.moe_a2a_backend),
            "moe_runner_backend": str(exec_moe.moe_runner_backend),
            "disable_shared_experts_fusion": bool(exec_moe.disable_shared_experts_fusion),
            "enforce_shared_experts_fusion": bool(exec_moe.enforce_shared_experts_fusion),
        }
        stage = "model_config"
        model_config = ModelConfig.from_server_args(server_args)
        if draft:
            model_config = ModelConfig.from_server_args(
                server_args, model_path=str(config_dir(point["draft_config"])),
                is_draft_model=True)
        model_class, arch = get_model_architecture(model_config)
        known["config_architectures"] = list(getattr(model_config.hf_config, "architectures", None) or [])
        stage = "quantization"
        quant_config = _get_quantization_config(model_config, LoadConfig(load_format="dummy"))
        stage = "shared_experts"
        scope = moe_utils.draft_model_build_scope() if draft else contextlib.nullcontext()
        with scope:
            disabled, fused_n, override = loader_fusion(moe_utils, model_class, model_config.hf_config,
                                                        quant_config)
            # The reason SGLang logs (on rank 0 of an initialised group only): its gate, asked
            # as the loader's step asks it.
            gate = getattr(model_class, "shared_experts_fusion_disable_reason", None)
            reason = (None if exec_moe.disable_shared_experts_fusion or gate is None
                      else gate(model_config.hf_config, quant_config))
            # The Qwen2-MoE block decides its own fusion while the model builds, under the loader's decision.
            with override():
                in_block = block_fusion(model_class, model_config.hf_config, quant_config)
        stage = "load_weights"
        if draft:
            nextn_load_check(model_class, model_config.hf_config)
        stage = "forward"
        branch = forward_branch(model_class.__name__, model_config.hf_config, quant_config)
        dispatcher = experts_dispatcher()
        # 0.5.20 has no post_experts_output_is_complete: its should_skip_post_experts_all_reduce lists the same
        # complete combines, among the reasons a later step runs the sum
        complete = getattr(moe_utils, "post_experts_output_is_complete", None) or \
            moe_utils.should_skip_post_experts_all_reduce
        complete_ep, complete_tp = complete(is_tp_path=False), complete(is_tp_path=True)
    except Exception as e:
        if _raised_here(e):     # the oracle's own call does not fit this release: an oracle error, not SGLang's
            raise
        return {"refused": True, "stage": stage, "message": _message(e), **known}

    b = branch["branch"] or ""
    dispatch_branch = any(w in b for w in DISPATCH_BRANCH_WORDS)
    if branch["block"] is None or b.startswith("not_implemented"):
        # No MoE block (a dense draft), or a branch SGLang's file does not implement.
        forward_path, all_reduce = None, None
    elif dispatch_branch:
        # The dispatch branches of these files combine and never reduce afterwards.
        forward_path, all_reduce = "a2a", False
    else:
        a2a_inside = dispatcher in A2A_DISPATCHERS or (complete_ep and complete_tp
                                                       and rewritten["moe_a2a_backend"] != "none")
        forward_path = "a2a" if a2a_inside else "normal"
        all_reduce = bool((parallel.moe_ep_size > 1 and not complete_ep)
                          or (parallel.moe_tp_size > 1 and not complete_tp))
    hf = model_config.hf_text_config
    layers = getattr(hf, "num_hidden_layers", None)
    pp = point.get("pp", 1)
    # A draft runs in a singleton pipeline group (get_pp_indices ignores the partition).
    ranges = ([list(get_pp_indices(layers, r, pp)) for r in range(pp)]
              if layers and not draft else None)
    eplb_enabled = bool(get_exec().moe.enable_eplb) and not draft
    eplb_layers = None
    if eplb_enabled and ranges:
        sparse = _sparse_layers(model_class, hf, layers)
        eplb_layers = [[i for i in sparse if s <= i < e] for s, e in ranges] if sparse is not None else None
    return {
        "refused": False,
        "entry_class": model_class.__name__,
        "architecture": arch,
        # What SGLang's ModelConfig made of the checkpoint's config (a NextN draft's
        # architectures name the NextN class): what the runner would send the registry.
        "config_architectures": list(getattr(model_config.hf_config, "architectures", None) or []),
        "quantization": quant_config.get_name() if quant_config is not None else None,
        "rewritten": rewritten,
        "shared_experts_fusion": (in_block > 0 if in_block is not None else not disabled and fused_n > 0),
        "fusion_disabled": bool(disabled),
        "num_fused_shared_experts": in_block if in_block is not None else int(fused_n),
        "fusion_reason": ("--disable-shared-experts-fusion" if exec_moe.disable_shared_experts_fusion
                          else "decided by the Qwen2-MoE block" if in_block is not None
                          else reason or (None if gate else "no shared_experts_fusion_disable_reason gate")),
        "block": branch.get("block"),
        "branch": branch.get("branch"),
        "dispatcher": dispatcher,
        "combine_complete": bool(complete_ep and complete_tp),
        "forward_path": forward_path,
        "post_experts_all_reduce": all_reduce,
        "pp_layer_ranges": ranges,
        "eplb_enabled": eplb_enabled,
        "eplb_layers": eplb_layers,
        "seconds": round(time.perf_counter() - started, 3),
    }


def _sparse_layers(model_class, hf, layers):
    """The layers holding routed experts, by the family decoder's own `_is_layer_sparse`."""
    for mod_name, decoder in SPARSE_PREDICATES.items():
        mod = importlib.import_module(mod_name)
        entry_classes = tuple(v for n, v in vars(mod).items() if n.endswith("ForCausalLM") and isinstance(v, type))
        if issubclass(model_class, entry_classes):
            predicate = getattr(mod, decoder)._is_layer_sparse
            if next(iter(inspect.signature(predicate).parameters)) == "self":   # 0.5.21 and before: a method
                stand_in = __import__("types").SimpleNamespace(config=hf)
                return [i for i in range(layers) if predicate(stand_in, i, is_nextn=False)]
            return [i for i in range(layers) if predicate(hf, i, is_nextn=False)]
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", required=True, choices=sorted(sglang_cpu.DEVICES))
    parser.add_argument("--engine-env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment switch SGLang reads, set before SGLang is imported (its module-level "
                             "reads see it, as on a server started with it); a point names the same in engine_env")
    args = parser.parse_args(argv)
    engine_env = dict(item.split("=", 1) for item in args.engine_env)
    os.environ.update(engine_env)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    for name, value in DISPATCH_BUDGETS.items():
        os.environ.setdefault(name, value)
    logging.getLogger().setLevel(logging.ERROR)   # SGLang's start-up chatter
    sglang_cpu.emulate(args.device)
    t0 = time.time()
    import sglang.srt.models.registry  # noqa: F401  (imports every model file once)
    # SGLang's registry skips a model file that fails to import: on this CPU that would answer for another class
    # (its transformers fallback). Every model file the oracle reads that this release ships must import.
    for module in sorted({m for m, _ in FAMILY_BLOCKS.values()} | set(BLOCK_FUSION.values())):
        if importlib.util.find_spec(module) is not None:
            importlib.import_module(module)
    from sglang.srt.model_loader.utils import get_model_architecture  # noqa: F401
    print(json.dumps({"ready": True, "sglang": sglang_cpu.sglang_version(),
                      "device": args.device, "import_s": round(time.time() - t0, 1)}), flush=True)
    out = sys.stdout
    for line in sys.stdin:
        if not line.strip():
            continue
        point = json.loads(line)
        if point.get("device", args.device) != args.device:
            result = {"error": f"device: this oracle emulates {args.device}, not {point['device']}"}
        elif point.get("engine_env", {}) != engine_env:
            result = {"error": f"engine_env: this oracle runs with {engine_env}, not {point.get('engine_env')}"}
        else:
            with contextlib.redirect_stdout(sys.stderr):
                try:
                    result = answer(point)
                except Exception:
                    result = {"error": traceback.format_exc(limit=4)}
        out.write(json.dumps({"point": point, "answer": result}, sort_keys=True) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
