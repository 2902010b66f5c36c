"""Reading config.json (a dict) with errors that name the field (`config.<name>: ...`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

from loadplan.config_view import ConfigView
from loadplan.errors import InvalidArgument

if TYPE_CHECKING:
    from ..layers.rope import RopeConfig


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class DecoderConfig:
    """The fields every family's config dataclass names (causal_lm.CausalLM reads them, and `moe_layers`)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: "RopeConfig"


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


def window_of(cfg, layer_id: int) -> int | None:
    """cfg.sliding_window where layer `layer_id` is a "sliding_attention" layer (cfg.layer_types), else None."""
    return cfg.sliding_window if cfg.layer_types[layer_id] == "sliding_attention" else None


def windowed_layer_types(d: dict, n_layers: int, every_field: str, every_default: int) -> list[str]:
    """`layer_types` (full_attention / sliding_attention per layer), else every `every_field`-th layer global and the
    others windowed: layer i global iff (i + 1) % every == 0 (transformers' default for EXAONE-MoE and AFMoE)."""
    if d.get("layer_types") is not None:
        return per_layer(d, "layer_types", n_layers, WINDOW_LAYER_TYPES, [])
    every = get_field(d, every_field, every_default, int)
    if every < 1:
        raise ConfigError(f"config.{every_field}: must be >= 1, got {every}")
    return ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n_layers)]


def transformers_defaults(*, vocab_size: int, hidden_size: int, num_attention_heads: int, num_key_value_heads: int,
                          head_dim: int, max_position_embeddings: int, rms_norm_eps: float = 1e-6,
                          tie_word_embeddings: bool = False) -> dict:
    """`Family.defaults` of the fields every decoder's config names, with the family's transformers defaults."""
    return dict(vocab_size=vocab_size, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
                num_key_value_heads=num_key_value_heads, head_dim=head_dim, rms_norm_eps=rms_norm_eps,
                hidden_act="silu", max_position_embeddings=max_position_embeddings,
                tie_word_embeddings=tie_word_embeddings)


REQUIRED = _MISSING   # a field a config must say (transformers has no default the engine can use)

# a config dataclass field's annotation -> the JSON kinds its value may have
_KINDS = {"int": int, "float": (int, float), "bool": bool, "str": str, "int | None": int, "float | None": (int, float)}


class Fields(dict):
    """The fields of a config dataclass read so far, by name: `fields.hidden_size` is `fields.hidden_size`."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    __setattr__ = dict.__setitem__


def read_fields(d: dict, cls, defaults: Mapping[str, Any], names: Mapping[str, str] | None = None) -> dict:
    """The fields of config dataclass `cls` that `defaults` names, in its order, read from config.json `d`:
    `d[names.get(field, field)]` checked against the field's annotation (int, float, bool, str), else its default
    (REQUIRED: refused as missing; a callable: of the fields read before it)."""
    names = names or {}
    kinds = {f.name: _KINDS.get(f.type) for f in dataclasses.fields(cls)}
    out = Fields()
    for field, default in defaults.items():
        key = names.get(field, field)
        if d.get(key) is None and callable(default):
            out[field] = default(out)
            continue
        value = get_field(d, key, default, kinds[field])
        out[field] = float(value) if kinds[field] == (int, float) and value is not None else value
    return out


@dataclass(frozen=True)
class Family:
    """A family as data: the registry's reader of its layers and experts (`layout`, one of `loadplan.layouts`'), the
    config.json fields it reads with transformers' defaults (`defaults`, `read_fields`; `names` where config.json
    spells a field otherwise), what it fixes whatever the config says (`fixed`: a value, or a function of the fields
    read), how it reads its rotary embedding (`rope`: `read_rope`'s options) and what it reads its own way (`own`:
    functions of config.json and the fields read so far that return more fields, or None, and refuse what the family
    cannot run with a ConfigError). Read by `Family.read`."""

    architecture: str
    layout: Callable
    defaults: Mapping[str, Any]
    names: Mapping[str, str] = field(default_factory=dict)
    fixed: Mapping[str, Any] = field(default_factory=dict)
    rope: Mapping[str, Any] | Callable[[dict], Any] | None = field(default_factory=dict)
    own: tuple[Callable[[dict, dict], dict | None], ...] = ()
    shared: str | None = None   # the field that sizes the shared expert, read only where the layout has one (else 0)
    draft: bool = False         # a Multi-Token-Prediction draft's row: its layout's layers follow the target's

    def read(self, d: dict, cls, *, layout=None, **extra):
        """config.json `d` as `cls` (a config dataclass whose `layout_fields(layout, d, draft)` gives the fields of
        the registry's layout; `layout`: already read, by another family's reader): this row's fields, then `extra`
        (what the family reads itself)."""
        from ..layers.mlp import activation

        layout = moe_layout(self.layout, d) if layout is None else layout
        fields = read_fields(d, cls, self.defaults, self.names)
        fields.update(cls.layout_fields(layout, d, self.draft))
        if "hidden_act" in fields:
            activation(fields.hidden_act)   # refuses unknown activations by name
        if callable(self.rope):     # the family's own reading of its rope
            fields["rope"] = self.rope(d)
        elif self.rope is not None:   # None: the family reads its ropes itself (`own`)
            fields["rope"] = read_rope(d, **self.rope)
        if self.shared:
            key = self.names.get(self.shared, self.shared)
            fields[self.shared] = get_field(d, key, kind=int) if layout.n_shared else 0
        for name, value in self.fixed.items():
            fields[name] = value(fields) if callable(value) else value
        for step in self.own:
            fields.update(step(d, fields) or {})
        if "architecture" in {f.name for f in dataclasses.fields(cls)}:
            fields["architecture"] = self.architecture
        return cls(**fields, **extra)


def at_least(name: str, minimum: int, key: str | None = None):
    """A step of `Family.own` that refuses the field `name` (config.json's `key`) when it is set and < `minimum`."""
    def check(d: dict, fields: dict) -> None:
        value = fields.get(name)
        if value is not None and value < minimum:
            raise ConfigError(f"config.{key or name}: must be >= {minimum} or null, got {value}")
    return check


def heads_wide(fields: dict) -> int:
    """The default head_dim: hidden_size // num_attention_heads."""
    return fields.hidden_size // fields.num_attention_heads


def as_heads(fields: dict) -> int:
    """The default num_key_value_heads: num_attention_heads (no grouping)."""
    return fields.num_attention_heads


def whole_heads(family: str):
    """A step of `Family.own` that refuses a partial rotary embedding: `family` rotates whole heads."""
    def check(d: dict, fields: dict) -> None:
        factor = fields.rope.partial_rotary_factor
        if factor != 1.0:
            raise ConfigError(f"config.rope_parameters: partial_rotary_factor {factor} is not supported; {family} "
                              f"rotates whole heads")
    return check


def windowed_layers(default_kind: Callable[[int, int], str], window: int):
    """A step of `Family.own` that reads `layer_types` (full_attention or sliding_attention per layer; layer i of n
    `default_kind(i, n)` by default) and `sliding_window` (`window` when absent or null)."""
    def read(d: dict, fields: dict) -> dict:
        n = fields.num_hidden_layers
        types = per_layer(d, "layer_types", n, WINDOW_LAYER_TYPES, [default_kind(i, n) for i in range(n)])
        return {"layer_types": tuple(types), "sliding_window": sliding_window(d, window)}
    return read
