"""Weight loading for parallel layouts: EPLB's redundant physical slots, and a wrapper's prefixed head
and embedding on pipeline stages (Kimi-K2.5 keeps its DeepSeek body under `language_model.`)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from loadplan.engine.loader import load_model
from loadplan.engine.weights import Target, WeightLayout, build_state_dict, is_local, remap
from loadplan.plan import Parallel

from engine_helpers import LocalRegistry

P = "language_model."


def test_a_prefixed_tied_head_on_the_last_stage_reads_the_prefixed_embedding():
    last = WeightLayout(n_routed=8, layer_range=(2, 3), has_embed=False, lm_head_from_embed=True)
    assert remap(f"{P}model.embed_tokens.weight", last) == Target(f"{P}lm_head.weight")
    assert is_local(remap(f"{P}model.embed_tokens.weight", last), last)
    first = WeightLayout(n_routed=8, layer_range=(0, 2), has_head=False)
    for name in (f"{P}lm_head.weight", f"{P}model.norm.weight"):
        assert not is_local(remap(name, first), first), name
    assert is_local(remap(f"{P}model.embed_tokens.weight", first), first)
    untied = WeightLayout(n_routed=8, layer_range=(2, 3), has_embed=False)
    assert not is_local(remap(f"{P}model.embed_tokens.weight", untied), untied)


def test_redundant_physical_slots_are_filled_with_their_experts_replicas():
    """4 experts, 6 physical slots over 2 ranks: slot p holds expert p % 4 (eplb.Placement.initial)."""
    D, I, n = 2, 3, 4
    ck = {}
    for e in range(n):
        for proj, shape in (("gate", (I, D)), ("up", (I, D)), ("down", (D, I))):
            ck[f"model.layers.0.mlp.experts.{e}.{proj}_proj.weight"] = torch.full(shape, float(e))
    for rank, want in ((0, [0, 1, 2]), (1, [3, 0, 1])):
        lay = WeightLayout(n_routed=n, num_physical=6, local_experts=(3 * rank, 3 * rank + 3))
        expected = {"model.layers.0.mlp.experts.gate_up_proj": torch.empty(3, 2 * I, D, device="meta"),
                    "model.layers.0.mlp.experts.down_proj": torch.empty(3, D, I, device="meta")}
        state, report = build_state_dict(list(ck), ck.__getitem__, lambda k: ck[k].shape, expected, lay)
        assert [int(state["model.layers.0.mlp.experts.gate_up_proj"][s, 0, 0]) for s in range(3)] == want
        assert [int(state["model.layers.0.mlp.experts.down_proj"][s, 0, 0]) for s in range(3)] == want
        assert report.skipped_other_ranks == 3 * (n - len(set(want)))


def test_kimi_wrapper_with_tied_embeddings_splits_over_two_stages(tmp_path):
    transformers = pytest.importorskip("transformers")
    from families import DEEPSEEK_TINY
    from engine_helpers import randomize

    torch.manual_seed(0)
    body = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**DEEPSEEK_TINY,
                                                                            tie_word_embeddings=True))
    randomize(body, 0)
    body.save_pretrained(tmp_path / "ds")
    text = json.loads((tmp_path / "ds" / "config.json").read_text())
    kimi = tmp_path / "kimi"
    kimi.mkdir()
    (kimi / "config.json").write_text(json.dumps({"architectures": ["KimiK25ForConditionalGeneration"],
                                                  "model_type": "kimi_k25", "text_config": text}))
    state = {f"{P}{k}": v for k, v in load_file(tmp_path / "ds" / "model.safetensors").items()}
    assert f"{P}lm_head.weight" not in state                       # tied: only the embedding is stored
    state["vision_tower.patch_embed.weight"] = torch.randn(8, 3)
    save_file(state, kimi / "model.safetensors")
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(2))
    whole = load_model(kimi, registry=LocalRegistry())
    s0, s1 = (load_model(kimi, Parallel(pp_size=2, pp_rank=r), registry=LocalRegistry(), deployment="kimi-pp")
              for r in range(2))
    with torch.no_grad():
        want = whole(ids)
        got = s1(hidden_states=s0(ids))
    assert (got - want).abs().max().item() <= 1e-5
