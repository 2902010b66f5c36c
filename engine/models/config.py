"""Reading config.json (a dict) with errors that name the field (`config.<name>: ...`)."""

from __future__ import annotations

from loadplan.config_view import ConfigView
from loadplan.errors import InvalidArgument


class ConfigError(ValueError):
    pass


_MISSING = object()


def get_field(d: dict, name: str, default=_MISSING, kind=None):
    """d[name]; `default` when absent or null (no default: ConfigError); `kind` checks the type
    (a bool is not accepted as an int)."""
    v = d.get(name)
    if v is None:
        if default is _MISSING:
            raise ConfigError(f"config.{name}: missing")
        return default
    if kind is not None and (not isinstance(v, kind) or (kind is not bool and isinstance(v, bool))):
        raise ConfigError(f"config.{name}: expected {getattr(kind, '__name__', kind)}, got {v!r}")
    return v


def moe_layout(reader, d: dict):
    """The layer and expert fields of config `d` (layers, MoE layers, routed and shared expert counts, top-k) as
    the registry reads them: `reader` is one of `loadplan.layouts`' readers, the one reader of those
    fields, so the engine builds the very layout its plan was decided for. Its refusals become ConfigError, which
    names the field as the registry does."""
    try:
        return reader(ConfigView(d))
    except InvalidArgument as e:
        raise ConfigError(str(e)) from None


def per_layer(d: dict, name: str, n_layers: int, choices: tuple[str, ...], default: list[str]) -> list[str]:
    """A list with one of `choices` per layer (`layer_types`, `mlp_layer_types`); `default` when absent or null."""
    value = d.get(name)
    if value is None:
        value = default
    if not isinstance(value, list) or len(value) != n_layers or any(v not in choices for v in value):
        raise ConfigError(f"config.{name}: expected {n_layers} entries of {', '.join(choices)}, got {value!r}"[:300])
    return value


def read_rope(d: dict, **options):
    """`layers.rope.rope_config_from_hf(d, **options)`, its refusal naming the field the config says it in."""
    from ..layers.rope import rope_config_from_hf

    try:
        return rope_config_from_hf(d, **options)
    except ValueError as e:
        raise ConfigError(f"config.{'rope_scaling' if d.get('rope_scaling') else 'rope_parameters'}: {e}") from None


def sliding_window(d: dict, default: int) -> int:
    """config.sliding_window, `default` when absent or null; it must be >= 1."""
    window = get_field(d, "sliding_window", default, int)
    if window < 1:
        raise ConfigError(f"config.sliding_window: must be >= 1, got {window}")
    return window


WINDOW_LAYER_TYPES = ("full_attention", "sliding_attention")


def windowed_layer_types(d: dict, n_layers: int, every_field: str, every_default: int) -> list[str]:
    """`layer_types` (full_attention / sliding_attention per layer), else every `every_field`-th layer global and the
    others windowed: layer i global iff (i + 1) % every == 0 (transformers' default for EXAONE-MoE and AFMoE)."""
    if d.get("layer_types") is not None:
        return per_layer(d, "layer_types", n_layers, WINDOW_LAYER_TYPES, [])
    every = get_field(d, every_field, every_default, int)
    if every < 1:
        raise ConfigError(f"config.{every_field}: must be >= 1, got {every}")
    return ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n_layers)]


def common_fields(d: dict, *, vocab_size: int, hidden_size: int, num_attention_heads: int,
                  num_key_value_heads: int, head_dim: int, max_position_embeddings: int, rms_norm_eps: float = 1e-6,
                  tie_word_embeddings: bool = False) -> dict:
    """The fields every decoder's config names, read with the family's transformers defaults (the keyword arguments):
    sizes, norm epsilon, activation (refused by name when unknown), context length, tied head."""
    from ..layers.mlp import activation

    act = get_field(d, "hidden_act", "silu", str)
    activation(act)
    return dict(
        vocab_size=get_field(d, "vocab_size", vocab_size, int),
        hidden_size=get_field(d, "hidden_size", hidden_size, int),
        num_attention_heads=get_field(d, "num_attention_heads", num_attention_heads, int),
        num_key_value_heads=get_field(d, "num_key_value_heads", num_key_value_heads, int),
        head_dim=get_field(d, "head_dim", head_dim, int),
        rms_norm_eps=float(get_field(d, "rms_norm_eps", rms_norm_eps, (int, float))),
        hidden_act=act,
        max_position_embeddings=get_field(d, "max_position_embeddings", max_position_embeddings, int),
        tie_word_embeddings=bool(get_field(d, "tie_word_embeddings", tie_word_embeddings, bool)),
    )
