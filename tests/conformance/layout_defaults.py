"""The registry's layout readers against the config classes a checkpoint's config.json is read with.

A reader (loadplan.service.rules.layouts) may read a config only as the references do: a field left out as the
reference's config class fills it in, a field under another name as the class's attribute map reads it, a field the
reference does not read not at all; or else refuse the config, naming a field (where the references disagree, or a
default is not the registry's to guess). Never as something else: a plan that counts a shared expert or a dense
layer the engine does not build is a wrong plan, not an error.

For each entry class the registry builds directly (a wrapper's inner config is its inner entry class's), the
reference config class is looked up by the model_type its config.json says (`MODEL_TYPES`), in transformers'
registry (`CONFIG_MAPPING`, what AutoConfig reads with) or, in SGLang's environment, SGLang's own first (what its
get_config reads with). Its defaults (with `FILL` for the layout fields it has no default for) are the complete
config; each layout field of it is then left out in turn, each alias of one given instead, and (against
transformers) each layout field name it does not have given a value.

Run in-process by tests/conformance/test_layout_defaults.py against transformers, and as a script in SGLang's
environment (`.venv-sglang`) against the classes SGLang reads with: `python layout_defaults.py` prints one JSON
object, {"checked": [the entry classes SGLang builds and has a config class for], "disagreements": [...]}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parents[2]

# entry class -> the model_type of its config.json (for a draft: its target's, which it is read from)
MODEL_TYPES = {
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "DeepseekV32ForCausalLM": "deepseek_v32",
    "GlmMoeDsaForCausalLM": "glm_moe_dsa",
    "DeepseekV3ForCausalLMNextN": "deepseek_v3",
    "Dots1ForCausalLM": "dots1",
    "Ernie4_5_MoeForCausalLM": "ernie4_5_moe",
    "Glm4MoeForCausalLM": "glm4_moe",
    "Glm4MoeForCausalLMNextN": "glm4_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "OlmoeForCausalLM": "olmoe",
    "FlexOlmoForCausalLM": "flex_olmo",
    "Lfm2MoeForCausalLM": "lfm2_moe",
    "JambaForCausalLM": "jamba",
    "DbrxForCausalLM": "dbrx",
    "MiMoV2FlashForCausalLM": "mimo_v2_flash",
    "GptOssForCausalLM": "gpt_oss",
    "MiniMaxM2ForCausalLM": "minimax_m2",
    "MiniMaxForCausalLM": "minimax",
    "GraniteMoeForCausalLM": "granitemoe",
    "GraniteMoeSharedForCausalLM": "granitemoeshared",
    "GraniteMoeSWAForCausalLM": "granitemoe_swa",
    "GraniteMoeHybridForCausalLM": "granitemoehybrid",
    "NemotronHForCausalLM": "nemotron_h",
    "HunYuanMoEV1ForCausalLM": "hunyuan_v1_moe",
    "ExaoneMoeForCausalLM": "exaone_moe",
    "Cohere2MoeForCausalLM": "cohere2_moe",
    "Step3p5ForCausalLM": "step3p5",
    "SarvamMLAForCausalLM": "sarvam_mla",
    "HYV3ForCausalLM": "hy_v3",
    "Mistral4ForCausalLM": "mistral4",
    "AXK1ForCausalLM": "axk1",
    "MellumForCausalLM": "mellum",
    "FlintForCausalLM": "flint",
    "Kolibri1ForCausalLM": "kolibri1",
    "LagunaForCausalLM": "laguna",
    "SarvamMoEForCausalLM": "sarvam_moe",
    "KimiLinearForCausalLM": "kimi_linear",
    "LongcatFlashForCausalLM": "longcat_flash",
    "SolarOpenForCausalLM": "solar_open",
    "BailingHybridForCausalLM": "bailing_hybrid",
    "AfmoeForCausalLM": "afmoe",
    "PhiMoEForCausalLM": "phimoe",
    "PhimoeForCausalLM": "phimoe",
    "Llama4ForCausalLM": "llama4_text",
    "Glm4MoeLiteForCausalLM": "glm4_moe_lite",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3NextForCausalLMMTP": "qwen3_next",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
    "Qwen3_5ForCausalLMMTP": "qwen3_5_moe_text",
    "Glm4MoeLiteForCausalLMNextN": "glm4_moe_lite",
    "Qwen3ForCausalLM": "qwen3",
    "MiniMaxM3SparseForCausalLM": "minimax_m2",
    "DeepseekV4ForCausalLM": "deepseek_v4",
    "Dots3NoteForCausalLM": "dots3_note",
    # SGLang's Pixtral hands it a text_config of model_type deepseek_v3 (entry_classes.py)
    "MistralLarge3ForCausalLM": "deepseek_v3",
}

# Layout fields some config classes have no default for (None), or do not write (SGLang's LongcatFlashConfig keeps
# num_layers as its num_hidden_layers): a value to complete the config with.
FILL = {"num_hidden_layers": 4, "n_routed_experts": 8, "num_experts": 8, "num_local_experts": 8,
        "num_experts_per_tok": 2, "n_shared_experts": 1, "num_layers": 28}

def layout_fields() -> set[str]:
    """The config fields the readers name: the guard test's list (tests/engine/models/test_layout_fields_read_once.py)."""
    sys.path.insert(0, str(ROOT / "tests" / "engine" / "models"))
    from test_layout_fields_read_once import layout_fields as named

    return named()


def _read(reader: Callable, d: dict) -> Any:
    from loadplan.service.rules.config_view import ConfigView

    return reader(ConfigView(d, "config"))


def _complete(config_class, reader: Callable) -> tuple[dict, dict]:
    """The config class's defaults, with FILL for the layout fields the reader refuses them for (no default, or one
    that builds no MoE layer, such as 0 experts): (the complete config, the FILL values it took)."""
    from loadplan.service.errors import InvalidArgument

    given: dict = {}
    for _ in range(len(FILL) + 1):
        full = {**config_class(**given).to_dict(), **given}
        try:
            _read(reader, full)
            return full, given
        except InvalidArgument as err:
            name = err.field.removeprefix("config.")
            if name not in FILL or name in given:   # a default the reader refuses (none, or 0 experts)
                raise
            given[name] = FILL[name]
    raise AssertionError("unreachable")


def disagreements(config_class_of: Callable[[str], Any], entry_classes: list[str], *,
                  unread: bool) -> Iterator[str]:
    """For each entry class, each layout field its reference config class fills in that the reader, when the field
    is left out, reads otherwise, and each name of a field the reader reads otherwise than the class (a refusal
    agrees: it is never a wrong layout). `unread`: a layout field name the class neither has nor maps must not change
    the layout either (transformers' models read their config class's fields; SGLang's read any a config.json
    gives, through getattr)."""
    from loadplan.entry_classes import ENTRY_CLASSES
    from loadplan.service.errors import InvalidArgument
    from loadplan.service.rules import entries

    fields = layout_fields()
    for arch in entry_classes:
        model_type = MODEL_TYPES[arch]
        reader = entries.FAMILIES[ENTRY_CLASSES[arch].family].layout
        config_class = config_class_of(model_type)
        if config_class is None:   # this environment cannot read such a config at all
            continue
        try:
            full, given = _complete(config_class, reader)
        except InvalidArgument as err:
            yield f"{arch}: {config_class.__name__}'s defaults are refused: {err}"
            continue
        want = _read(reader, full)
        for name in sorted(fields & {k for k, v in full.items() if v is not None}):
            partial = {k: v for k, v in full.items() if k != name}
            try:
                got = _read(reader, partial)
            except InvalidArgument:
                continue
            if got != want:
                yield (f"{arch}: without {name} ({config_class.__name__} fills in {json.dumps(full[name])[:60]}) "
                       f"{_differ(got, want)}")
        # A draft reads its MTP layers' count, which a target's config class need not have.
        draft = ENTRY_CLASSES[arch].family.endswith("_nextn")
        yield from _names(arch, reader, config_class, full, given, want, fields, unread=unread and not draft)


def _names(arch: str, reader: Callable, config_class, full: dict, given: dict, want: Any, fields: set[str], *,
           unread: bool) -> Iterator[str]:
    """The names of fields: one the config class maps to a layout field (its attribute_map) is read as that field;
    (`unread`) a layout field name it neither has nor maps is not read (a refusal that names it agrees)."""
    from loadplan.service.errors import InvalidArgument

    aliases = dict(getattr(config_class, "attribute_map", {}) or {})
    for alias, name in sorted(aliases.items()):
        if name not in fields or alias not in fields or not isinstance(full.get(name), int):
            continue
        value = full[name] + 1
        partial = {k: v for k, v in full.items() if k != name}
        if config_class(**{**given, alias: value}).to_dict().get(name) != value:
            continue                                      # this class does not read the alias as a kwarg
        try:
            same = _read(reader, {**full, name: value})
            got = _read(reader, {**partial, alias: value})
        except InvalidArgument:       # refused (that value, or the alias as the field's missing name): agrees
            continue
        if got != same:
            yield f"{arch}: {alias}={value}, {config_class.__name__}'s name of {name}, is not read as {name}"
    for name in sorted(fields - set(full) - set(aliases)) if unread else ():
        for value in (3, 5):
            try:
                got = _read(reader, {**full, name: value})
            except InvalidArgument:
                continue
            if got != want:
                yield f"{arch}: {name}={value}, which {config_class.__name__} does not read, {_differ(got, want)}"


def _differ(got: Any, want: Any) -> str:
    differ = [f for f in ("layer_ids", "moe_layers", "n_routed", "n_shared", "top_k") if getattr(got, f) != getattr(want, f)]
    return (f"changes the reader's {', '.join(differ)}: "
            + "; ".join(f"{f} {str(getattr(got, f))[:40]} vs {str(getattr(want, f))[:40]}" for f in differ))


def transformers_config_class(model_type: str):
    """transformers' class for `model_type` (None: this transformers has none)."""
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type] if model_type in CONFIG_MAPPING else None


def sglang_config_class(model_type: str):
    """The class SGLang 0.5.23's get_config reads a config.json of `model_type` with: its own where it registers
    one (utils/hf_transformers/common.py: _CONFIG_REGISTRY), else transformers'."""
    from sglang.srt.utils.hf_transformers.common import _CONFIG_REGISTRY

    return _CONFIG_REGISTRY.get(model_type) or transformers_config_class(model_type)


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import sglang_cpu

    sglang_cpu.emulate("cuda:9.0")   # SGLang's package imports GPU-only modules; its config classes need none
    from sglang.srt.models.registry import ModelRegistry

    built = set(ModelRegistry.get_supported_archs())   # what SGLang builds: its defaults matter for these alone
    checked = sorted(a for a in MODEL_TYPES if a in built and sglang_config_class(MODEL_TYPES[a]) is not None)
    found = list(disagreements(sglang_config_class, checked, unread=False))
    print(json.dumps({"checked": checked, "disagreements": found}))


if __name__ == "__main__":
    main()
