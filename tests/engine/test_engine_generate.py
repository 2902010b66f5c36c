"""Greedy decoding with the KV cache equals transformers' greedy generate."""

from __future__ import annotations

import pytest
import torch

from loadplan.engine.generate import generate
from loadplan.engine.loader import load_model
from loadplan.plan import Runtime

from engine_helpers import LocalRegistry, hf_reference, make_checkpoint, prompt


@pytest.mark.parametrize("arch, fused", [("Qwen3MoeForCausalLM", False), ("Qwen2MoeForCausalLM", True),
                                         ("Qwen2MoeForCausalLM", False)])
def test_greedy_tokens_equal_transformers(tmp_path, arch, fused):
    path = make_checkpoint(tmp_path, arch, num_hidden_layers=2)
    ids = prompt(B=2, T=5)
    n = 8
    with torch.no_grad():
        want = hf_reference(path, arch).generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n,
                                                 pad_token_id=0)[:, ids.shape[1]:]
    model = load_model(path, registry=LocalRegistry(), runtime=Runtime(disable_shared_experts_fusion=not fused))
    got = generate(model, ids, n)
    assert got.tolist() == want.tolist()


def test_cached_decoding_matches_full_forward_and_stops_at_eos(tmp_path):
    path = make_checkpoint(tmp_path, "Qwen3MoeForCausalLM", num_hidden_layers=2)
    model = load_model(path, registry=LocalRegistry())
    ids = prompt(B=1, T=4)[0].tolist()
    new = generate(model, ids, 6)[0].tolist()
    # each token is the argmax of an uncached forward over everything before it
    seq = list(ids)
    for tok in new:
        with torch.no_grad():
            assert model(torch.tensor([seq]))[0, -1].argmax().item() == tok
        seq.append(tok)
    assert all(getattr(l.self_attn, "kv_cache", None) is None for l in model.model.layers)   # caches released
    stopped = generate(model, ids, 6, eos_token_id=new[2])[0].tolist()
    assert stopped == new[:new.index(new[2]) + 1]


def test_generate_from_checkpoint_stops_where_transformers_does(tmp_path):
    import json

    from loadplan.engine.generate import generate_from_checkpoint

    arch = "Qwen2MoeForCausalLM"
    path = make_checkpoint(tmp_path, arch, num_hidden_layers=2)
    ids = prompt(B=1, T=4)
    free = generate_from_checkpoint(path, ids[0].tolist(), 6, registry=LocalRegistry())["tokens"]
    eos = free[2]
    for name in ("config.json", "generation_config.json"):
        f = path / name
        cfg = json.loads(f.read_text())
        cfg["eos_token_id"] = eos
        f.write_text(json.dumps(cfg))
    with torch.no_grad():
        want = hf_reference(path, arch).generate(ids, max_new_tokens=6, do_sample=False)[0, 4:].tolist()
    out = generate_from_checkpoint(path, ids[0].tolist(), 6, registry=LocalRegistry())
    assert out["tokens"] == want == free[:free.index(eos) + 1]
    assert isinstance(out["plan_id"], str) and out["plan_id"]
