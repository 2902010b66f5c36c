"""Rotary embeddings against transformers' own rotary classes, in both config spellings."""

from __future__ import annotations

import math

import pytest
import torch

from loadplan.engine.layers.rope import (
    RopeConfig,
    RotaryEmbedding,
    apply_rotary,
    rope_config_from_hf,
    softmax_scale,
    yarn_get_mscale,
)

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds  # noqa: E402
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf_qwen  # noqa: E402

YARN = {"factor": 40.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}
YARN_UNEVEN = {"factor": 8.0, "original_max_position_embeddings": 128, "beta_fast": 16, "beta_slow": 2,
               "mscale": 0.707, "mscale_all_dim": 1.0}


def _spell(kind: str, rope_type: str | None, theta: float, extra: dict) -> dict:
    """One rope setting in the old (rope_theta + rope_scaling) or new (rope_parameters) spelling."""
    if kind == "old":
        scaling = None if rope_type is None else {"type": rope_type, **extra}
        return {"rope_theta": theta, "rope_scaling": scaling}
    return {"rope_parameters": {"rope_type": rope_type or "default", "rope_theta": theta, **extra}}


def _deepseek_cfg(rope: dict) -> dict:
    return dict(hidden_size=64, num_attention_heads=2, qk_rope_head_dim=16, qk_nope_head_dim=8, v_head_dim=8,
                kv_lora_rank=16, q_lora_rank=None, max_position_embeddings=2560, num_hidden_layers=1,
                vocab_size=32, **rope)


def _qwen_cfg(rope: dict) -> dict:
    return dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                max_position_embeddings=4096, num_hidden_layers=1, vocab_size=32, **rope)


CASES = [
    ("deepseek", None, {}),
    ("deepseek", "yarn", YARN),
    ("deepseek", "yarn", YARN_UNEVEN),
    ("qwen", None, {}),
    ("qwen", "linear", {"factor": 4.0}),
    ("qwen", "yarn", {"factor": 4.0, "original_max_position_embeddings": 1024}),
    # Llama 3 / Llama 4: a band of wavelengths between 64 / 4 and 64 is interpolated, longer ones divided by 8
    ("qwen", "llama3", {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 64}),
    # Llama-4-Scout's: high_freq_factor == low_freq_factor (no band; transformers warns and runs it)
    ("qwen", "llama3", {"factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                        "original_max_position_embeddings": 64}),
]


@pytest.mark.parametrize("spelling", ["old", "new"])
@pytest.mark.parametrize("family,rope_type,extra", CASES)
def test_cos_sin_match_transformers(family, rope_type, extra, spelling):
    theta = 10000.0 if family == "deepseek" else 1_000_000.0
    if family == "deepseek":
        raw = _deepseek_cfg(_spell(spelling, rope_type, theta, dict(extra)))
        hf_cfg = transformers.DeepseekV3Config(**raw)
        ref = hf_ds.DeepseekV3RotaryEmbedding(hf_cfg)
        head_dim = raw["qk_rope_head_dim"]
    else:
        raw = _qwen_cfg(_spell(spelling, rope_type, theta, dict(extra)))
        hf_cfg = transformers.Qwen3MoeConfig(**raw)
        ref = hf_qwen.Qwen3MoeRotaryEmbedding(hf_cfg)
        head_dim = raw["head_dim"]
    rope = rope_config_from_hf(raw)
    assert rope.rope_type == (rope_type or "default")
    ours = RotaryEmbedding(head_dim, rope, raw["max_position_embeddings"])
    positions = torch.tensor([0, 1, 2, 7, 63, 64, 500, 2047])
    cos, sin = ours(positions)
    ref_cos, ref_sin = ref(torch.zeros(1, dtype=torch.float32), positions[None])
    assert cos.shape == (len(positions), head_dim)
    assert ours.attention_factor == pytest.approx(ref.attention_scaling)
    torch.testing.assert_close(cos, ref_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, ref_sin[0], rtol=0, atol=1e-6)


def test_yarn_changes_the_frequencies():
    """Guards the comparison above against a reference that silently ignored the scaling."""
    plain = RotaryEmbedding(16, RopeConfig(), 4096)
    yarn = RotaryEmbedding(16, rope_config_from_hf({"rope_scaling": {"type": "yarn", **YARN_UNEVEN}}), 4096)
    assert not torch.allclose(plain.inv_freq, yarn.inv_freq)
    assert yarn.attention_factor != 1.0


def test_llama3_scales_long_wavelengths_and_interpolates_the_middle_band():
    plain = RotaryEmbedding(32, RopeConfig(theta=1e6), 4096)
    scaled = RotaryEmbedding(32, rope_config_from_hf({"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 1e6, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}), 4096)
    ratio = (plain.inv_freq / scaled.inv_freq).tolist()
    assert ratio[0] == 1.0 and ratio[-1] == pytest.approx(8.0)
    assert any(1.0 < r < 8.0 for r in ratio)                 # the smoothed band
    with pytest.raises(ValueError, match="llama3 rope needs low_freq_factor"):
        rope_config_from_hf({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 64}})


def test_yarn_factor_defaults_to_context_ratio():
    cfg = rope_config_from_hf({"max_position_embeddings": 4096,
                               "rope_scaling": {"type": "yarn", "original_max_position_embeddings": 1024}})
    assert cfg.factor == 4.0


def test_unsupported_rope_type_names_the_supported_ones():
    with pytest.raises(ValueError, match="supported: default, linear, yarn, llama3"):
        rope_config_from_hf({"rope_scaling": {"type": "longrope", "factor": 2.0}})


def test_ntk_alpha_is_only_a_dynamic_rope_with_an_alpha_read_by_a_family_that_says_so():
    """Hunyuan's "dynamic" rope with an alpha is a fixed stretch of the base; elsewhere (and without an alpha, where
    the frequencies would follow the sequence length) "dynamic" is refused."""
    hub = {"rope_theta": 10000.0, "rope_scaling": {"type": "dynamic", "alpha": 1000.0, "factor": 1.0}}
    with pytest.raises(ValueError, match="'dynamic' not supported; supported: default, linear, yarn, llama3$"):
        rope_config_from_hf(hub)
    cfg = rope_config_from_hf(hub, ntk_alpha=True)
    assert (cfg.rope_type, cfg.theta, cfg.alpha) == ("ntk_alpha", 10000.0, 1000.0)
    inv = RotaryEmbedding(8, cfg, 64).inv_freq                       # base 1e4 * 1000 ** (8 / 6) = 1e8
    torch.testing.assert_close(inv, torch.tensor([1.0, 1e-2, 1e-4, 1e-6]))
    with pytest.raises(ValueError, match=r"supported: .*dynamic \(with alpha\)"):
        rope_config_from_hf({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, ntk_alpha=True)
    with pytest.raises(ValueError, match="alpha must be a number > 0"):
        rope_config_from_hf({"rope_scaling": {"type": "dynamic", "alpha": "big"}}, ntk_alpha=True)


def test_null_rope_scaling_is_default():
    cfg = rope_config_from_hf({"rope_theta": 5e5, "rope_scaling": None})
    assert cfg == RopeConfig(theta=5e5)


@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rotary_matches_transformers(interleaved):
    torch.manual_seed(0)
    rope = rope_config_from_hf({"rope_theta": 10000.0, "rope_scaling": {"type": "yarn", **YARN_UNEVEN}})
    emb = RotaryEmbedding(16, rope, 1024)
    positions = torch.arange(5) + 3
    cos, sin = emb(positions)
    q = torch.randn(2, 3, 5, 16)
    k = torch.randn(2, 1, 5, 16)
    fn = hf_ds.apply_rotary_pos_emb_interleave if interleaved else hf_ds.apply_rotary_pos_emb
    ref_q, ref_k = fn(q, k, cos[None], sin[None])
    torch.testing.assert_close(apply_rotary(q, cos, sin, interleaved=interleaved), ref_q, rtol=0, atol=1e-6)
    torch.testing.assert_close(apply_rotary(k, cos, sin, interleaved=interleaved), ref_k, rtol=0, atol=1e-6)


def test_rotation_preserves_relative_position():
    """<rot(q, m), rot(k, n)> depends only on m - n, in both layouts."""
    torch.manual_seed(1)
    emb = RotaryEmbedding(16, RopeConfig(), 128)
    q, k = torch.randn(16), torch.randn(16)
    for interleaved in (False, True):
        def dot(m, n):
            cos, sin = emb(torch.tensor([m, n]))
            return (apply_rotary(q, cos[0], sin[0], interleaved=interleaved)
                    @ apply_rotary(k, cos[1], sin[1], interleaved=interleaved)).item()
        assert dot(10, 3) == pytest.approx(dot(27, 20), abs=1e-4)
        assert dot(10, 3) != pytest.approx(dot(10, 4), abs=1e-4)


def test_softmax_scale_matches_deepseek():
    cfg = transformers.DeepseekV3Config(**_deepseek_cfg(_spell("old", "yarn", 10000.0, dict(YARN))))
    rope = rope_config_from_hf(_deepseek_cfg(_spell("old", "yarn", 10000.0, dict(YARN))))
    expected = hf_ds.yarn_apply_mscale(cfg.rope_parameters, 24 ** -0.5)
    assert softmax_scale(24, rope) == pytest.approx(expected)
    assert softmax_scale(24, rope) == pytest.approx(24 ** -0.5 * (0.1 * math.log(40.0) + 1.0) ** 2)
    assert softmax_scale(24, RopeConfig()) == 24 ** -0.5
    assert yarn_get_mscale(1.0, 1.0) == 1.0
