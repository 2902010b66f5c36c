"""The name remapping (a pure function over a table) and the hard checks of build_state_dict."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loadplan.engine.weights import (DuplicateTensor, LayoutMismatch, MissingTensor, ShapeMismatch, Target,
                                     UnexpectedTensor, WeightLayout, build_state_dict, is_local, remap, tp_split_dim)

UNFUSED = WeightLayout(n_routed=8)
FUSED = WeightLayout(n_routed=8, num_fused_shared=1)
L = "model.layers.3.mlp"


@pytest.mark.parametrize("name, target", [
    (f"{L}.experts.5.gate_proj.weight", Target(f"{L}.experts.gate_up_proj", 5, "gate")),
    (f"{L}.experts.5.up_proj.weight", Target(f"{L}.experts.gate_up_proj", 5, "up")),
    (f"{L}.experts.0.down_proj.weight", Target(f"{L}.experts.down_proj", 0)),
    (f"{L}.shared_expert.up_proj.weight", Target(f"{L}.shared_expert.up_proj.weight")),
    (f"{L}.shared_expert_gate.weight", Target(f"{L}.shared_expert_gate.weight")),
    (f"{L}.gate.weight", Target(f"{L}.gate.weight")),
    ("model.layers.0.self_attn.q_proj.bias", Target("model.layers.0.self_attn.q_proj.bias")),
    ("model.embed_tokens.weight", Target("model.embed_tokens.weight")),
])
def test_remap_unfused(name, target):
    assert remap(name, UNFUSED) == target


@pytest.mark.parametrize("name, target", [
    # Qwen2-MoE's singular and DeepSeek's plural spelling both become routed slot n_routed.
    (f"{L}.shared_expert.gate_proj.weight", Target(f"{L}.experts.gate_up_proj", 8, "gate")),
    (f"{L}.shared_experts.up_proj.weight", Target(f"{L}.experts.gate_up_proj", 8, "up")),
    (f"{L}.shared_expert.down_proj.weight", Target(f"{L}.experts.down_proj", 8)),
    # the sigmoid gate stays a Linear: its output is the fused slot's routing weight
    (f"{L}.shared_expert_gate.weight", Target(f"{L}.shared_expert_gate.weight")),
    # an already pre-fused checkpoint
    (f"{L}.experts.8.down_proj.weight", Target(f"{L}.experts.down_proj", 8)),
    (f"{L}.experts.7.gate_proj.weight", Target(f"{L}.experts.gate_up_proj", 7, "gate")),
])
def test_remap_fused(name, target):
    assert remap(name, FUSED) == target


def test_prefused_checkpoint_into_unfused_layout_is_refused():
    with pytest.raises(LayoutMismatch, match=r"experts\.8\.up_proj.*fused layout"):
        remap(f"{L}.experts.8.up_proj.weight", UNFUSED)


def test_tied_head_on_a_stage_without_the_embedding_reads_the_embedding():
    lay = WeightLayout(n_routed=8, has_embed=False, lm_head_from_embed=True)
    assert remap("model.embed_tokens.weight", lay) == Target("lm_head.weight")


def test_is_local_pipeline_stage_and_expert_range():
    lay = WeightLayout(n_routed=8, num_fused_shared=1, local_experts=(4, 8), layer_range=(2, 4),
                       has_embed=False, has_head=True)
    assert not is_local(Target("model.layers.1.self_attn.q_proj.weight"), lay)
    assert is_local(Target("model.layers.2.self_attn.q_proj.weight"), lay)
    assert not is_local(Target("model.layers.4.input_layernorm.weight"), lay)
    assert not is_local(Target("model.embed_tokens.weight"), lay)
    assert is_local(Target("model.norm.weight"), lay) and is_local(Target("lm_head.weight"), lay)
    assert not is_local(Target(f"{L}.experts.down_proj", 3), lay)
    assert is_local(Target(f"{L}.experts.down_proj", 4), lay)
    assert is_local(Target(f"{L}.experts.down_proj", 8), lay)      # the fused slot lives on every rank
    first = WeightLayout(n_routed=8, layer_range=(0, 2), has_embed=True, has_head=False)
    assert not is_local(Target("model.norm.weight"), first) and not is_local(Target("lm_head.weight"), first)


# -- build_state_dict over a dict "checkpoint" ------------------------------------------

D, I, E = 4, 3, 2
UNFUSED_SMALL = WeightLayout(n_routed=E)


def _expected(fused: bool, local=None):
    slots = (local[1] - local[0] if local else E) + (1 if fused else 0)
    sd = {
        "model.norm.weight": torch.empty(D, device="meta"),
        f"{L}.gate.weight": torch.empty(E, D, device="meta"),
        f"{L}.experts.gate_up_proj": torch.empty(slots, 2 * I, D, device="meta"),
        f"{L}.experts.down_proj": torch.empty(slots, D, I, device="meta"),
        f"{L}.shared_expert_gate.weight": torch.empty(1, D, device="meta"),
    }
    if not fused:
        for p, shape in (("gate", (I, D)), ("up", (I, D)), ("down", (D, I))):
            sd[f"{L}.shared_expert.{p}_proj.weight"] = torch.empty(shape, device="meta")
    return sd


def _checkpoint(seed=0):
    g = torch.Generator().manual_seed(seed)
    ck = {"model.norm.weight": torch.randn(D, generator=g), f"{L}.gate.weight": torch.randn(E, D, generator=g),
          f"{L}.shared_expert_gate.weight": torch.randn(1, D, generator=g)}
    for e in [*map(str, range(E))] + ["shared"]:
        base = f"{L}.experts.{e}" if e != "shared" else f"{L}.shared_expert"
        ck[f"{base}.gate_proj.weight"] = torch.randn(I, D, generator=g)
        ck[f"{base}.up_proj.weight"] = torch.randn(I, D, generator=g)
        ck[f"{base}.down_proj.weight"] = torch.randn(D, I, generator=g)
    return ck


def _build(ck, expected, layout):
    return build_state_dict(list(ck), ck.__getitem__, lambda n: tuple(ck[n].shape), expected, layout)


def test_experts_are_stacked_gate_then_up_and_the_shared_expert_fills_the_fused_slot():
    ck = _checkpoint()
    sd, report = _build(ck, _expected(fused=True), WeightLayout(n_routed=E, num_fused_shared=1))
    gu, down = sd[f"{L}.experts.gate_up_proj"], sd[f"{L}.experts.down_proj"]
    for e in range(E):
        assert torch.equal(gu[e, :I], ck[f"{L}.experts.{e}.gate_proj.weight"])
        assert torch.equal(gu[e, I:], ck[f"{L}.experts.{e}.up_proj.weight"])
        assert torch.equal(down[e], ck[f"{L}.experts.{e}.down_proj.weight"])
    assert torch.equal(gu[E, :I], ck[f"{L}.shared_expert.gate_proj.weight"])
    assert torch.equal(down[E], ck[f"{L}.shared_expert.down_proj.weight"])
    assert report.loaded == len(ck)


def test_unfused_keeps_the_shared_expert_apart():
    ck = _checkpoint()
    sd, _ = _build(ck, _expected(fused=False), UNFUSED_SMALL)
    assert sd[f"{L}.experts.gate_up_proj"].shape[0] == E
    assert torch.equal(sd[f"{L}.shared_expert.up_proj.weight"], ck[f"{L}.shared_expert.up_proj.weight"])



def test_expert_parallel_rank_loads_only_its_experts():
    ck = _checkpoint()
    lay = WeightLayout(n_routed=E, num_fused_shared=1, local_experts=(1, 2))
    sd, report = _build(ck, _expected(fused=True, local=(1, 2)), lay)
    gu = sd[f"{L}.experts.gate_up_proj"]
    assert gu.shape[0] == 2
    assert torch.equal(gu[0, I:], ck[f"{L}.experts.1.up_proj.weight"])
    assert torch.equal(gu[1, :I], ck[f"{L}.shared_expert.gate_proj.weight"])
    assert report.skipped_other_ranks == 3   # expert 0's gate, up, down


def test_missing_tensor_is_named():
    ck = _checkpoint()
    del ck[f"{L}.experts.1.up_proj.weight"]
    with pytest.raises(MissingTensor, match=r"model\.layers\.3\.mlp\.experts\.1\.up_proj\.weight"):
        _build(ck, _expected(fused=False), UNFUSED_SMALL)
    ck = _checkpoint()
    del ck["model.norm.weight"]
    with pytest.raises(MissingTensor, match=r"model\.norm\.weight"):
        _build(ck, _expected(fused=False), UNFUSED_SMALL)


def test_unexpected_tensor_is_named():
    ck = _checkpoint()
    ck["model.layers.3.mlp.extra.weight"] = torch.zeros(2)
    with pytest.raises(UnexpectedTensor, match=r"model\.layers\.3\.mlp\.extra\.weight"):
        _build(ck, _expected(fused=False), UNFUSED_SMALL)
    ck = _checkpoint()
    ck[f"{L}.experts.9.up_proj.weight"] = torch.zeros(I, D)   # beyond the fused slot
    with pytest.raises(UnexpectedTensor, match=r"experts\.9\.up_proj"):
        _build(ck, _expected(fused=True), WeightLayout(n_routed=E, num_fused_shared=1))


def test_a_tensor_loaded_twice_is_an_error():
    ck = _checkpoint()
    ck[f"{L}.experts.{E}.down_proj.weight"] = torch.zeros(D, I)   # pre-fused copy AND shared_expert.*
    with pytest.raises(DuplicateTensor, match="shared_expert.down_proj"):
        _build(ck, _expected(fused=True), WeightLayout(n_routed=E, num_fused_shared=1))


def test_shape_mismatch_is_named():
    ck = _checkpoint()
    ck[f"{L}.experts.0.down_proj.weight"] = torch.zeros(D, I + 1)
    with pytest.raises(ShapeMismatch, match=r"experts\.0\.down_proj\.weight.*\[4, 4\].*\[4, 3\]"):
        _build(ck, _expected(fused=False), UNFUSED_SMALL)


def test_ignored_prefixes_are_counted_not_loaded():
    ck = _checkpoint()
    ck["vision_tower.blocks.0.weight"] = torch.zeros(1)
    ck["vision_tower.blocks.1.weight"] = torch.zeros(1)
    lay = WeightLayout(n_routed=E, ignore_prefixes=("vision_tower.",))
    _, report = _build(ck, _expected(fused=False), lay)
    assert report.ignored == {"vision_tower.": 2}


def test_a_tensor_the_checkpoint_shares_is_read_from_its_source_only_when_absent():
    ck = _checkpoint()
    expected = dict(_expected(fused=False), **{"mtp.embed.weight": torch.empty(2, 3, device="meta")})
    ck["main.embed.weight"] = torch.arange(6.0).view(2, 3)
    lay = WeightLayout(n_routed=E, ignore_prefixes=("main.",), shared_from=(("mtp.embed.weight", "main.embed.weight"),))
    sd, report = _build(ck, expected, lay)
    assert torch.equal(sd["mtp.embed.weight"], ck["main.embed.weight"]) and report.ignored == {"main.": 1}
    ck["mtp.embed.weight"] = -torch.arange(6.0).view(2, 3)          # its own copy: that one, the source unread
    sd, _ = _build(ck, expected, lay)
    assert torch.equal(sd["mtp.embed.weight"], ck["mtp.embed.weight"])
    del ck["mtp.embed.weight"], ck["main.embed.weight"]              # neither: missing, by its own name
    with pytest.raises(MissingTensor, match=r"mtp\.embed\.weight"):
        _build(ck, expected, lay)


def _ungated(drop=(), add=()):
    """A checkpoint and meta state dict of one MoE layer whose experts have no gate (up_proj, down_proj)."""
    g = torch.Generator().manual_seed(3)
    ck = {f"{L}.experts.{e}.{p}_proj.weight": torch.randn(*shape, generator=g)
          for e in range(E) for p, shape in (("up", (I, D)), ("down", (D, I)))}
    for name in drop:
        del ck[name]
    ck.update({name: torch.zeros(I, D) for name in add})
    expected = {f"{L}.experts.gate_up_proj": torch.empty(E, I, D, device="meta"),
                f"{L}.experts.down_proj": torch.empty(E, D, I, device="meta")}
    return ck, expected


def test_ungated_experts_read_up_proj_into_the_whole_first_projection():
    ck, expected = _ungated()
    sd, report = _build(ck, expected, WeightLayout(n_routed=E, gated_experts=False))
    for e in range(E):
        assert torch.equal(sd[f"{L}.experts.gate_up_proj"][e], ck[f"{L}.experts.{e}.up_proj.weight"])
    assert report.loaded == 2 * E


def test_ungated_experts_refuse_a_gate_projection_and_name_a_missing_up_projection():
    ck, expected = _ungated(add=[f"{L}.experts.1.gate_proj.weight"])
    with pytest.raises(UnexpectedTensor, match=r"experts\.1\.gate_proj\.weight': this model's experts have no gate"):
        _build(ck, expected, WeightLayout(n_routed=E, gated_experts=False))
    ck, expected = _ungated(drop=[f"{L}.experts.1.up_proj.weight"])
    with pytest.raises(MissingTensor, match=r"1 tensor\(s\) missing .* model\.layers\.3\.mlp\.experts\.1\.up_proj"):
        _build(ck, expected, WeightLayout(n_routed=E, gated_experts=False))


def test_an_error_names_the_checkpoint_spelling_of_a_tensor_a_view_renamed():
    ck = _checkpoint()
    ck[f"{L}.experts.0.down_proj.weight"] = torch.zeros(D, I + 1)
    spelled = {f"{L}.experts.0.down_proj.weight": "backbone.layers.3.mixer.experts.0.down_proj.weight"}
    with pytest.raises(ShapeMismatch, match=r"experts\.0\.down_proj\.weight.* \[checkpoint tensor "
                                            r"'backbone\.layers\.3\.mixer\.experts\.0\.down_proj\.weight'\]"):
        build_state_dict(list(ck), ck.__getitem__, lambda n: tuple(ck[n].shape), _expected(fused=False),
                         UNFUSED_SMALL, source_name=lambda n: spelled.get(n, n))


# -- tensor parallelism: each rank reads its part of the split tensors -----------------------

A = "model.layers.0.self_attn"
M = "model.layers.0.mlp"


@pytest.mark.parametrize("param, dim", [
    (f"{A}.q_proj.weight", 0), (f"{A}.k_proj.bias", 0), (f"{A}.v_proj.weight", 0), (f"{A}.o_proj.weight", 1),
    (f"{A}.o_proj.bias", None),                       # added once, after the all-reduce
    (f"{M}.gate_proj.weight", 0), (f"{M}.up_proj.weight", 0), (f"{M}.down_proj.weight", 1),
    (f"{L}.experts.gate_up_proj", 0), (f"{L}.experts.down_proj", 1),
    (f"{L}.shared_expert.gate_proj.weight", None),    # an unfused shared expert runs replicated
    (f"{L}.shared_experts.down_proj.weight", None),
    (f"{L}.gate.weight", None), (f"{A}.q_norm.weight", None), ("model.embed_tokens.weight", None),
    ("lm_head.weight", None),
])
def test_tp_split_dims(param, dim):
    assert tp_split_dim(param, WeightLayout(n_routed=8, tp_size=2, tp_rank=1)) == dim
    assert tp_split_dim(param, WeightLayout(n_routed=8)) is None       # no tensor parallelism: nothing split


def test_the_a2a_path_reads_the_routed_experts_whole_on_tp_ranks():
    """tp_split_experts False (the a2a path, engine/moe.py): only the stacked routed experts stay whole;
    attention and the dense MLP are still split."""
    whole = WeightLayout(n_routed=8, tp_size=2, tp_rank=1, tp_split_experts=False)
    assert tp_split_dim(f"{L}.experts.gate_up_proj", whole) is None
    assert tp_split_dim(f"{L}.experts.down_proj", whole) is None
    assert tp_split_dim(f"{A}.q_proj.weight", whole) == 0 and tp_split_dim(f"{M}.down_proj.weight", whole) == 1
    ck = {f"{L}.experts.{e}.{p}_proj.weight": torch.randn((D, 4) if p == "down" else (4, D))
          for e in range(E) for p in ("gate", "up", "down")}
    expected = {f"{L}.experts.gate_up_proj": torch.empty(E, 8, D, device="meta"),
                f"{L}.experts.down_proj": torch.empty(E, D, 4, device="meta")}
    sd, report = _build(ck, expected, whole)
    for e in range(E):
        assert torch.equal(sd[f"{L}.experts.gate_up_proj"][e, 4:], ck[f"{L}.experts.{e}.up_proj.weight"])
        assert torch.equal(sd[f"{L}.experts.down_proj"][e], ck[f"{L}.experts.{e}.down_proj.weight"])
    assert report.loaded == len(ck)


def test_a_tp_rank_reads_its_part_of_each_split_tensor_and_the_rest_whole():
    g = torch.Generator().manual_seed(0)
    ck = {f"{A}.q_proj.weight": torch.randn(8, D, generator=g), f"{A}.q_proj.bias": torch.randn(8, generator=g),
          f"{A}.o_proj.weight": torch.randn(D, 8, generator=g), f"{A}.o_proj.bias": torch.randn(D, generator=g),
          f"{L}.gate.weight": torch.randn(E, D, generator=g)}
    for e in range(E):
        ck[f"{L}.experts.{e}.gate_proj.weight"] = torch.randn(4, D, generator=g)
        ck[f"{L}.experts.{e}.up_proj.weight"] = torch.randn(4, D, generator=g)
        ck[f"{L}.experts.{e}.down_proj.weight"] = torch.randn(D, 4, generator=g)
    expected = {f"{A}.q_proj.weight": torch.empty(4, D, device="meta"),
                f"{A}.q_proj.bias": torch.empty(4, device="meta"),
                f"{A}.o_proj.weight": torch.empty(D, 4, device="meta"),
                f"{A}.o_proj.bias": torch.empty(D, device="meta"),
                f"{L}.gate.weight": torch.empty(E, D, device="meta"),
                f"{L}.experts.gate_up_proj": torch.empty(E, 4, D, device="meta"),
                f"{L}.experts.down_proj": torch.empty(E, D, 2, device="meta")}
    for rank in range(2):
        sd, report = _build(ck, expected, WeightLayout(n_routed=E, tp_size=2, tp_rank=rank))
        part = slice(4 * rank, 4 * rank + 4)
        assert torch.equal(sd[f"{A}.q_proj.weight"], ck[f"{A}.q_proj.weight"][part])
        assert torch.equal(sd[f"{A}.q_proj.bias"], ck[f"{A}.q_proj.bias"][part])
        assert torch.equal(sd[f"{A}.o_proj.weight"], ck[f"{A}.o_proj.weight"][:, part])
        assert torch.equal(sd[f"{A}.o_proj.bias"], ck[f"{A}.o_proj.bias"])
        assert torch.equal(sd[f"{L}.gate.weight"], ck[f"{L}.gate.weight"])
        half = slice(2 * rank, 2 * rank + 2)
        for e in range(E):
            gu = sd[f"{L}.experts.gate_up_proj"][e]
            assert torch.equal(gu[:2], ck[f"{L}.experts.{e}.gate_proj.weight"][half])
            assert torch.equal(gu[2:], ck[f"{L}.experts.{e}.up_proj.weight"][half])
            assert torch.equal(sd[f"{L}.experts.down_proj"][e], ck[f"{L}.experts.{e}.down_proj.weight"][:, half])
        assert report.loaded == len(ck)


def test_a_tensor_that_does_not_split_over_the_tp_ranks_is_named():
    ck = {f"{A}.q_proj.weight": torch.zeros(6, D)}
    with pytest.raises(ShapeMismatch, match=rf"'{A}.q_proj.weight' of shape \[6, 4\] does not split over "
                                            rf"tp_size=4 along dimension 0"):
        _build(ck, {f"{A}.q_proj.weight": torch.empty(1, D, device="meta")}, WeightLayout(n_routed=E, tp_size=4))


def test_a_layer_beyond_the_model_is_unexpected_not_another_stages():
    """Layers of other pipeline stages are skipped; a layer the model does not have at all (a checkpoint of a
    deeper model) is refused by name, unless the family names it to skip (its draft layers)."""
    ck = _checkpoint()
    ck["model.layers.7.input_layernorm.weight"] = torch.ones(D)
    lay = dataclasses.replace(UNFUSED_SMALL, n_layers=4)
    with pytest.raises(UnexpectedTensor, match=r"'model\.layers\.7\.input_layernorm\.weight': layer 7 is beyond "
                                               r"the model's 4 layers"):
        _build(ck, _expected(fused=False), lay)
    stage = dataclasses.replace(lay, n_layers=8, layer_range=(0, 4))           # layer 7 is another stage's
    _, report = _build(ck, _expected(fused=False), stage)
    assert report.skipped_other_ranks == 1
    _, report = _build(ck, _expected(fused=False), dataclasses.replace(lay, ignore_prefixes=("model.layers.7.",)))
    assert report.ignored == {"model.layers.7.": 1}
