"""Tiny checkpoints and single-process references for the multi-rank engine tests.

Rank functions live in the test modules (module level, so the launcher can pickle
them); what they share is here, importable by name in the ranks too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine_helpers import LocalRegistry, make_checkpoint, randomize

QWEN3 = "Qwen3MoeForCausalLM"
QWEN2 = "Qwen2MoeForCausalLM"
DEEPSEEK = "DeepseekV3ForCausalLM"

# 256 routed experts: the registry's DeepSeek fusion gate passes (DESIGN 5.2); everything else tiny.
DEEPSEEK_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                     num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=256,
                     n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=1,
                     q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
                     max_position_embeddings=256, routed_scaling_factor=2.5, norm_topk_prob=True, rms_norm_eps=1e-6,
                     rope_theta=10000.0)


def make_deepseek(path: Path, seed: int = 0) -> Path:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**DEEPSEEK_TINY))
    randomize(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):   # a buffer: randomize() skips it
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
    model.save_pretrained(path)
    return path


def make_model(path: Path, arch: str, seed: int = 0) -> str:
    if arch == DEEPSEEK:
        make_deepseek(path, seed)
    else:
        make_checkpoint(path, arch, seed=seed)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == [arch]
    return str(path)


def single_process(path: str, ids: torch.Tensor, n_new: int, **load_kw) -> tuple[torch.Tensor, list[int]]:
    """(logits of `ids`, greedy tokens after ids[0]) of one process holding every layer and expert."""
    from loadplan.engine.generate import generate
    from loadplan.engine.loader import load_model

    model = load_model(path, registry=LocalRegistry(), **load_kw)
    with torch.no_grad():
        logits = model(ids)
    return logits, generate(model, ids[0], n_new)[0].tolist()
