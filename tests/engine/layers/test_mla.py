"""MLA against transformers' DeepseekV3Attention with copied weights; the cache against the full pass."""

from __future__ import annotations

import pytest
import torch

from loadplan.engine.layers.mla import MultiHeadLatentAttention
from loadplan.engine.layers.rope import RotaryEmbedding, rope_config_from_hf

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds  # noqa: E402

YARN = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 16, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def _cfg(q_lora_rank, interleave, rope_scaling):
    return dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=3, q_lora_rank=q_lora_rank,
                kv_lora_rank=20, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10, rope_interleave=interleave,
                rope_theta=10000.0, rope_scaling=rope_scaling, max_position_embeddings=640, num_hidden_layers=1,
                vocab_size=32, attention_bias=False)


def _pair(raw, seed=0):
    torch.manual_seed(seed)
    hf_cfg = transformers.DeepseekV3Config(**raw)
    hf_cfg._attn_implementation = "eager"
    ref = hf_ds.DeepseekV3Attention(hf_cfg, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            # Norm weights away from 1 and larger projections, so every parameter matters.
            p.copy_(torch.randn_like(p) * (0.5 if "layernorm" in name else 0.3) + ("layernorm" in name))
    rope = rope_config_from_hf(raw)
    ours = MultiHeadLatentAttention.from_hf_config(raw, rope)
    ours.load_state_dict(ref.state_dict(), strict=True)  # same names, straight copy
    rotary = RotaryEmbedding(raw["qk_rope_head_dim"], rope, raw["max_position_embeddings"])
    hf_rotary = hf_ds.DeepseekV3RotaryEmbedding(hf_cfg)
    return ref, ours, rotary, hf_rotary


def _hf_forward(ref, hf_rotary, x):
    T = x.shape[1]
    pos = torch.arange(T)[None]
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    return ref(x, position_embeddings=hf_rotary(x, pos), attention_mask=mask)[0]


@pytest.mark.parametrize("q_lora_rank", [24, None])
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("rope_scaling", [None, YARN])
def test_matches_transformers(q_lora_rank, interleave, rope_scaling):
    raw = _cfg(q_lora_rank, interleave, rope_scaling)
    ref, ours, rotary, hf_rotary = _pair(raw)
    x = torch.randn(2, 7, raw["hidden_size"])
    with torch.no_grad():
        expected = _hf_forward(ref, hf_rotary, x)
        cos, sin = rotary(torch.arange(7))
        got = ours(x, cos, sin)
    assert expected.abs().max() > 0.1
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_parameter_names_follow_the_checkpoint():
    with_lora = MultiHeadLatentAttention.from_hf_config(_cfg(24, True, None), rope_config_from_hf({}))
    without = MultiHeadLatentAttention.from_hf_config(_cfg(None, True, None), rope_config_from_hf({}))
    common = {"kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight"}
    assert set(with_lora.state_dict()) == common | {"q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight"}
    assert set(without.state_dict()) == common | {"q_proj.weight"}


def test_yarn_mscale_enters_the_softmax_scale():
    plain = MultiHeadLatentAttention.from_hf_config(_cfg(None, True, None), rope_config_from_hf({}))
    yarn_raw = _cfg(None, True, YARN)
    yarn = MultiHeadLatentAttention.from_hf_config(yarn_raw, rope_config_from_hf(yarn_raw))
    assert plain.scale == pytest.approx(14 ** -0.5)
    assert yarn.scale > plain.scale * 1.5  # (0.1 ln 40 + 1)^2 ~ 1.88


@pytest.mark.parametrize("chunks", [[7, 1, 1, 1], [3, 2, 1, 4]])
def test_cached_decoding_equals_the_full_pass(chunks):
    raw = _cfg(24, True, YARN)
    _, ours, rotary, _ = _pair(raw, seed=1)
    T = sum(chunks)
    x = torch.randn(2, T, raw["hidden_size"])
    with torch.no_grad():
        cos, sin = rotary(torch.arange(T))
        full = ours(x, cos, sin)
        ours.setup_cache(batch_size=2, max_seq_len=16, dtype=torch.float32, device="cpu")
        outs, start = [], 0
        for n in chunks:
            pos = torch.arange(start, start + n)
            c, s = rotary(pos)
            outs.append(ours(x[:, start:start + n], c, s, input_pos=pos))
            start += n
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=0, atol=1e-5)


def test_a_cache_needs_positions():
    raw = _cfg(None, True, None)
    _, ours, rotary, _ = _pair(raw)
    ours.setup_cache(1, 8, torch.float32, "cpu")
    cos, sin = rotary(torch.arange(2))
    with pytest.raises(ValueError, match="input_pos"):
        ours(torch.randn(1, 2, raw["hidden_size"]), cos, sin)


def test_attention_is_causal():
    raw = _cfg(None, False, None)
    _, ours, rotary, _ = _pair(raw, seed=2)
    x = torch.randn(1, 6, raw["hidden_size"])
    y = x.clone()
    y[:, 4:] += 1.0
    with torch.no_grad():
        cos, sin = rotary(torch.arange(6))
        a, b = ours(x, cos, sin), ours(y, cos, sin)
    torch.testing.assert_close(a[:, :4], b[:, :4], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 4:], b[:, 4:])
