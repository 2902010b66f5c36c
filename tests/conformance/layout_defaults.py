"""The registry's layout readers against the config classes a checkpoint's config.json is read with.

A reader (loadplan.layouts) may read a config only as the references do: a field left out as the
reference's config class fills it in, a field under another name as the class's attribute map reads it, a field the
reference does not read not at all; or else refuse the config, naming a field (where the references disagree, or a
default is not the registry's to guess). Never as something else: a plan that counts a shared expert or a dense
layer the engine does not build is a wrong plan, not an error.

For each entry class the registry builds directly (a wrapper's inner config is its inner entry class's), the
reference config class is looked up by the model_type its config.json says (`model_types()`), in transformers'
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

# Entry classes whose config.json's model_type transformers' causal-LM mapping does not give by their name (drafts,
# SGLang's names, the text models of multimodal families, families an older transformers lacks): the model_type
# their config.json says (a draft's: its target's).
OTHER_NAMES = {
    "DeepseekV3ForCausalLMNextN": "deepseek_v3",
    "Glm4MoeForCausalLMNextN": "glm4_moe",
    "Glm4MoeLiteForCausalLMNextN": "glm4_moe_lite",
    "Qwen3NextForCausalLMMTP": "qwen3_next",
    "Qwen3_5ForCausalLMMTP": "qwen3_5_moe_text",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
    "Llama4ForCausalLM": "llama4_text",
    "PhiMoEForCausalLM": "phimoe",
    "Step3p5ForCausalLM": "step3p5",
    "SarvamMLAForCausalLM": "sarvam_mla",
    "SarvamMoEForCausalLM": "sarvam_moe",
    "Mistral4ForCausalLM": "mistral4",
    "MiniMaxM3SparseForCausalLM": "minimax_m2",
    "Dots3NoteForCausalLM": "dots3_note",
    # SGLang's Pixtral hands it a text_config of model_type deepseek_v3 (entry_classes.py)
    "MistralLarge3ForCausalLM": "deepseek_v3",
}


def model_types() -> dict[str, str]:
    """Each entry class the registry builds directly -> the model_type of its config.json: transformers' causal-LM
    mapping read backwards, else OTHER_NAMES (absent where neither knows it)."""
    from loadplan.entry_classes import ENTRY_CLASSES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    by_name = {}
    for model_type, names in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        for name in names if isinstance(names, (list, tuple)) else [names]:
            by_name.setdefault(name, model_type)
    return {arch: OTHER_NAMES.get(arch) or by_name[arch] for arch, row in ENTRY_CLASSES.items()
            if not row.is_wrapper and (arch in OTHER_NAMES or arch in by_name)}


MODEL_TYPES = model_types()

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
    from loadplan.config_view import ConfigView

    return reader(ConfigView(d, "config"))


def _complete(config_class, reader: Callable) -> tuple[dict, dict]:
    """The config class's defaults, with FILL for the layout fields the reader refuses them for (no default, or one
    that builds no MoE layer, such as 0 experts): (the complete config, the FILL values it took)."""
    from loadplan.errors import InvalidArgument

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
    from loadplan.errors import InvalidArgument
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
    from loadplan.errors import InvalidArgument

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
