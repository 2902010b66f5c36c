"""Which layers exist and which are MoE, per family convention."""

from __future__ import annotations

import pytest

from loadplan.errors import InvalidArgument
from loadplan.service.rules import entries
from loadplan.config_view import ConfigView
from loadplan.layouts import (afmoe_layout, axk1_layout, bailing_hybrid_layout, cohere2_moe_layout,
                                            dbrx_layout,
                                            deepseek_layout, deepseek_nextn_layout, ernie4_5_moe_layout,
                                            every_layer_moe_layout, exaone_moe_layout, flint_layout,
                                            glm4_moe_nextn_layout,
                                            granitemoe_hybrid_layout,
                                            hunyuan_v1_moe_layout, hy_v3_layout,
                                            jamba_layout, kimi_linear_layout, kolibri1_layout, laguna_layout,
                                            lfm2_moe_layout,
                                            longcat_flash_layout, mellum_layout, mimo_v2_flash_layout,
                                            mistral4_layout, nemotron_h_layout, qwen_moe_layout, sarvam_mla_layout,
                                            sarvam_moe_layout, solar_open_layout, step3p5_layout)

from ._fixtures import deepseek, mixtral, qwen2, qwen3


@pytest.mark.parametrize("n,first_dense,freq,moe", [
    (4, 0, 1, [0, 1, 2, 3]),
    (4, 1, 1, [1, 2, 3]),
    (3, 5, 1, []),
    (3, 2, 2, [2]),            # no layer it would skip: read alike by every reference
])
def test_deepseek_moe_layers(n, first_dense, freq, moe):
    lay = deepseek_layout(ConfigView(deepseek(num_hidden_layers=n, first_k_dense_replace=first_dense,
                                              moe_layer_freq=freq)))
    assert lay.layer_ids == tuple(range(n))
    assert list(lay.moe_layers) == moe
    assert (lay.n_routed, lay.n_shared, lay.top_k) == (256, 1, 8)


@pytest.mark.parametrize("fields,field", [
    # SGLang (and the Hub's code) skip layers by moe_layer_freq, transformers does not read it
    ({"num_hidden_layers": 6, "first_k_dense_replace": 1, "moe_layer_freq": 2}, "moe_layer_freq"),
    # transformers' V3.2 and GLM-5 place MoE layers by mlp_layer_types, SGLang by first_k_dense_replace
    ({"num_hidden_layers": 3, "first_k_dense_replace": 1, "mlp_layer_types": ["dense", "dense", "sparse"]},
     "mlp_layer_types"),
])
def test_deepseek_refuses_fields_its_references_read_two_ways(fields, field):
    with pytest.raises(InvalidArgument) as e:
        deepseek_layout(ConfigView(deepseek(**fields)))
    assert e.value.field == f"config.{field}"
    lay = deepseek_layout(ConfigView(deepseek(num_hidden_layers=3, first_k_dense_replace=1,
                                              mlp_layer_types=["dense", "sparse", "sparse"])))
    assert lay.moe_layers == (1, 2)                                     # a list that agrees is read


@pytest.mark.parametrize("n,first_dense,freq,moe", [(6, 1, 2, [2, 4]), (7, 3, 3, [3, 6])])
def test_a_family_whose_references_all_read_moe_layer_freq_skips_layers_by_it(n, first_dense, freq, moe):
    lay = entries.FAMILIES["dots3"].layout(ConfigView({"num_hidden_layers": n, "first_k_dense_replace": first_dense,
                                                       "moe_layer_freq": freq}))
    assert list(lay.moe_layers) == moe


def test_deepseek_without_moe_layer_freq_every_layer_from_the_first_sparse_is_moe():
    cfg = deepseek(first_k_dense_replace=1)
    del cfg["moe_layer_freq"]
    assert list(deepseek_layout(ConfigView(cfg)).moe_layers) == [1, 2, 3]


@pytest.mark.parametrize("reader", [deepseek_layout, deepseek_nextn_layout])
@pytest.mark.parametrize("field", ["first_k_dense_replace", "n_shared_experts"])
def test_deepseek_refuses_what_its_references_default_differently(reader, field):
    # transformers' DeepseekV3Config fills in 3 dense layers and 1 shared expert, its DeepseekV2Config 0 and 2, the
    # Hub's configuration_deepseek.py (what SGLang reads with trust_remote_code) 0 and none: not ours to pick
    cfg = deepseek()
    del cfg[field]
    if reader is deepseek_nextn_layout and field == "first_k_dense_replace":
        assert reader(ConfigView(cfg)).n_shared == 1      # a draft's layers are all MoE: it does not read it
        return
    with pytest.raises(InvalidArgument) as e:
        reader(ConfigView(cfg))
    assert e.value.field == f"config.{field}"


@pytest.mark.parametrize("n,step,mlp_only,moe", [
    (4, 1, [], [0, 1, 2, 3]),
    (4, 2, [], [1, 3]),
    (6, 1, [0, 5], [1, 2, 3, 4]),
    (8, 2, [3], [1, 5, 7]),
])
def test_qwen_moe_layers(n, step, mlp_only, moe):
    """transformers' reading (SGLang makes every layer MoE: the sglang profile refuses the others)."""
    lay = qwen_moe_layout(ConfigView(qwen3(num_hidden_layers=n, decoder_sparse_step=step, mlp_only_layers=mlp_only)),
                          shared=False)
    assert list(lay.moe_layers) == moe and lay.n_shared == 0


def test_qwen2_shared_expert_counts_once_when_sized():
    assert qwen_moe_layout(ConfigView(qwen2()), shared=True).n_shared == 1
    assert qwen_moe_layout(ConfigView(qwen2(shared_expert_intermediate_size=0)), shared=True).n_shared == 0
    assert qwen_moe_layout(ConfigView(qwen2()), shared=False).n_shared == 0


def test_nextn_layers_follow_the_target():
    lay = deepseek_nextn_layout(ConfigView(deepseek(num_hidden_layers=61, num_nextn_predict_layers=2)))
    assert lay.layer_ids == (61, 62) and lay.moe_layers == (61, 62)
    cfg = deepseek(num_hidden_layers=61)
    assert deepseek_nextn_layout(ConfigView(cfg)).layer_ids == (61,)  # one MTP module by default


def test_glm4_nextn_layers_follow_the_target_under_glm_names_and_defaults():
    # GLM-4-MoE's config leaves n_shared_experts out at one shared expert and spells the experts num_local_experts
    # too (DeepSeek's reader would say no shared expert): the draft's rules and the engine read it as GLM does.
    cfg = {"num_hidden_layers": 46, "num_local_experts": 128, "num_experts_per_tok": 8, "num_nextn_predict_layers": 1}
    lay = glm4_moe_nextn_layout(ConfigView(cfg))
    assert lay.layer_ids == lay.moe_layers == (46,)
    assert (lay.n_routed, lay.n_shared, lay.top_k) == (128, 1, 8)
    assert entries.FAMILIES["glm4_moe_nextn"].layout is glm4_moe_nextn_layout


@pytest.mark.parametrize("fields,refused", [
    ({"n_routed_experts": 16, "num_experts": 8}, "config.num_experts"),
    ({"n_shared_experts": 1, "num_shared_experts": 2}, "config.num_shared_experts"),
])
def test_two_names_of_one_field_that_disagree_are_refused(fields, refused):
    with pytest.raises(InvalidArgument) as info:
        sarvam_mla_layout(ConfigView({"num_hidden_layers": 6, **fields}))
    assert info.value.field == refused and "two names of one field" in info.value.message


def test_two_names_of_one_field_that_agree_are_read():
    lay = sarvam_mla_layout(ConfigView({"num_hidden_layers": 6, "n_routed_experts": 16, "num_experts": 16}))
    assert lay.n_routed == 16


@pytest.mark.parametrize("fields,moe", [
    ({}, [1, 2, 3, 4, 5]),                                                      # transformers' defaults: from 1
    ({"moe_layer_start_index": 0, "moe_layer_end_index": 3}, [0, 1, 2, 3]),
    ({"moe_layer_interval": 2}, [1, 3, 5]),                                     # (i + 1) % 2 == 0
    ({"moe_layer_start_index": 2, "moe_layer_end_index": -1, "moe_layer_interval": 3}, [2, 5]),
])
def test_ernie4_5_moe_layers(fields, moe):
    lay = ernie4_5_moe_layout(ConfigView({"num_hidden_layers": 6, **fields}))
    assert list(lay.moe_layers) == moe and (lay.n_routed, lay.n_shared, lay.top_k) == (64, 2, 6)


@pytest.mark.parametrize("fields,field", [({"moe_layer_end_index": None}, "moe_layer_end_index"),
                                          ({"moe_k": 9, "moe_num_experts": 8}, "moe_k"),
                                          ({"moe_layer_interval": 0}, "moe_layer_interval")])
def test_ernie4_5_moe_refusals_name_the_field(fields, field):
    with pytest.raises(InvalidArgument) as e:
        ernie4_5_moe_layout(ConfigView({"num_hidden_layers": 6, **fields}))
    assert e.value.field == f"config.{field}"


@pytest.mark.parametrize("fields,moe", [
    ({}, [1, 2, 3]),                                                            # transformers' default: from 1
    ({"first_k_dense_replace": 2}, [2, 3]),
    ({"mlp_layer_types": ["sparse", "dense", "sparse", "dense"]}, [0, 2]),      # the list wins
])
def test_exaone_moe_layers(fields, moe):
    lay = exaone_moe_layout(ConfigView({"num_hidden_layers": 4, **fields}))
    assert list(lay.moe_layers) == moe and (lay.n_routed, lay.n_shared, lay.top_k) == (64, 1, 8)


@pytest.mark.parametrize("fields,moe,sizes", [
    ({}, [1, 2, 3, 4, 5], (192, 1, 8)),                                          # transformers' defaults
    ({"mlp_layer_types": ["sparse", "dense"] * 3, "num_local_experts": 16, "num_shared_experts": 2}, [0, 2, 4],
     (16, 2, 8)),
])
def test_hy_v3_layers(fields, moe, sizes):
    lay = hy_v3_layout(ConfigView({"num_hidden_layers": 6, **fields}))
    assert list(lay.moe_layers) == moe and (lay.n_routed, lay.n_shared, lay.top_k) == sizes


@pytest.mark.parametrize("fields,moe,sizes", [
    ({}, [1, 2, 3, 4, 5], (256, 1, 8)),                                          # transformers' defaults
    ({"mlp_layer_types": ["sparse"] * 6, "num_experts": 16, "num_experts_per_tok": 2}, list(range(6)), (16, 1, 2)),
])
def test_laguna_layers_and_mellums(fields, moe, sizes):
    lay = laguna_layout(ConfigView({"num_hidden_layers": 6, **fields}))
    assert list(lay.moe_layers) == moe and (lay.n_routed, lay.n_shared, lay.top_k) == sizes
    mellum = mellum_layout(ConfigView({"num_hidden_layers": 6, **fields}))     # every layer MoE by default, no shared
    want = list(range(6)) if "mlp_layer_types" not in fields else moe
    assert list(mellum.moe_layers) == want and mellum.n_shared == 0


@pytest.mark.parametrize("fields,moe,sizes", [
    ({}, [2, 3, 4, 5], (256, 1, 6)),                                             # transformers' defaults
    ({"mlp_only_layers": [], "decoder_sparse_step": 2, "num_experts": 16}, [1, 3, 5], (16, 1, 6)),
])
def test_flint_layers(fields, moe, sizes):
    lay = flint_layout(ConfigView({"num_hidden_layers": 6, **fields}))
    assert list(lay.moe_layers) == moe and (lay.n_routed, lay.n_shared, lay.top_k) == sizes


@pytest.mark.parametrize("fields,sizes", [({}, (384, 1, 6)), ({"num_local_experts": 16, "num_experts_per_tok": 2},
                                                                (16, 1, 2))])
def test_kolibri1_layers(fields, sizes):
    lay = kolibri1_layout(ConfigView({"num_hidden_layers": 6, **fields}))
    assert list(lay.moe_layers) == list(range(6)) and (lay.n_routed, lay.n_shared, lay.top_k) == sizes


@pytest.mark.parametrize("layout,fields,moe,sizes", [
    ("mla", {}, [1, 2, 3, 4, 5], (128, 1, 8)),                                   # transformers' defaults
    ("moe", {}, [1, 2, 3, 4, 5], (128, 1, 6)),
    ("mla", {"num_experts": 64, "num_shared_experts": 2, "first_k_dense_replace": 3}, [3, 4, 5], (64, 2, 8)),
    ("moe", {"n_routed_experts": 32, "moe_layer_freq": 1, "first_k_dense_replace": 0}, list(range(6)), (32, 1, 6)),
    ("mistral4", {"moe_layer_freq": 2}, [0, 1, 2, 3, 4, 5], (128, 1, 4)),       # transformers does not read it
    ("mistral4", {}, [0, 1, 2, 3, 4, 5], (128, 1, 4)),
    ("axk1", {}, [1, 2, 3, 4, 5], (192, 1, 8)),
    ("axk1", {"mlp_layer_types": ["sparse", "dense"] * 3, "first_k_dense_replace": 3}, [0, 2, 4], (192, 1, 8)),
    ("mistral4", {"num_local_experts": 16, "n_shared_experts": 0, "first_k_dense_replace": 2}, [2, 3, 4, 5],
     (16, 0, 4)),
])
def test_deepseek_named_layers(layout, fields, moe, sizes):
    of = {"mla": sarvam_mla_layout, "moe": sarvam_moe_layout, "mistral4": mistral4_layout, "axk1": axk1_layout}[layout]
    lay = of(ConfigView({"num_hidden_layers": 6, **fields}))
    assert list(lay.moe_layers) == moe and (lay.n_routed, lay.n_shared, lay.top_k) == sizes


@pytest.mark.parametrize("fields,moe,sizes", [
    ({}, [3, 4, 5], (288, 1, 8)),                                                # transformers' defaults
    ({"moe_layers_enum": "1,2,5", "num_local_experts": 16, "moe_top_k": 4}, [1, 2, 5], (16, 1, 4)),
    ({"moe_layers_enum": [0, 6], "num_nextn_predict_layers": 1}, [0], (288, 1, 8)),   # layer 6: the MTP layer
    ({"mlp_layer_types": ["sparse"] * 8, "num_mtp_layers": 2}, [0, 1, 2, 3, 4, 5], (288, 1, 8)),
    ({"mlp_layer_types": ["dense"] * 3 + ["sparse"] * 4, "num_nextn_predict_layers": 1}, [3, 4, 5], (288, 1, 8)),
])
def test_step3p5_layers(fields, moe, sizes):
    lay = step3p5_layout(ConfigView({"num_hidden_layers": 6, **fields}))
    assert list(lay.moe_layers) == moe and (lay.n_routed, lay.n_shared, lay.top_k) == sizes


@pytest.mark.parametrize("fields,field", [({"moe_layers_enum": "1,a"}, "moe_layers_enum"),
                                          ({"mlp_layer_types": ["sparse"] * 5}, "mlp_layer_types"),
                                          ({"moe_top_k": 300}, "moe_top_k")])
def test_step3p5_refusals_name_the_field(fields, field):
    with pytest.raises(InvalidArgument) as e:
        step3p5_layout(ConfigView({"num_hidden_layers": 6, **fields}))
    assert e.value.field == f"config.{field}"


@pytest.mark.parametrize("fields,moe,sizes", [
    ({}, [0, 1, 2, 3], (8, 0, 2)),                                               # transformers' defaults
    ({"first_k_dense_replace": 1, "num_experts": 16, "num_shared_experts": 2}, [1, 2, 3], (16, 2, 2)),
    ({"mlp_layer_types": ["dense", "sparse", "sparse", "sparse"], "first_k_dense_replace": 1}, [1, 2, 3], (8, 0, 2)),
])
def test_cohere2_moe_layers(fields, moe, sizes):
    lay = cohere2_moe_layout(ConfigView({"num_hidden_layers": 4, **fields}))
    assert list(lay.moe_layers) == moe and (lay.n_routed, lay.n_shared, lay.top_k) == sizes


@pytest.mark.parametrize("fields,moe,shared", [({"num_dense_layers": 1, "num_shared_experts": 2}, [1, 2, 3], 2),
                                                ({"num_dense_layers": 0, "num_shared_experts": 1}, [0, 1, 2, 3], 1)])
def test_afmoe_layers(fields, moe, shared):
    lay = afmoe_layout(ConfigView({"num_hidden_layers": 4, **fields}))
    assert list(lay.moe_layers) == moe and (lay.n_routed, lay.n_shared, lay.top_k) == (64, shared, 6)


@pytest.mark.parametrize("field", ["num_dense_layers", "num_shared_experts"])
def test_afmoe_requires_what_sglang_and_transformers_default_differently(field):
    # transformers' AfmoeConfig: 1 dense layer, 2 shared experts; SGLang's: 0 and 0
    fields = {"num_hidden_layers": 4, "num_dense_layers": 1, "num_shared_experts": 2}
    del fields[field]
    with pytest.raises(InvalidArgument) as e:
        afmoe_layout(ConfigView(fields))
    assert e.value.field == f"config.{field}"


def test_mimo_v2_flash_layers_by_mlp_layer_types():
    assert mimo_v2_flash_layout(ConfigView({"num_hidden_layers": 4})).moe_layers == (1, 2, 3)   # dense first
    lay = mimo_v2_flash_layout(ConfigView({"num_hidden_layers": 3, "num_local_experts": 16,
                                           "mlp_layer_types": ["sparse", "dense", "sparse"]}))
    assert lay.moe_layers == (0, 2) and (lay.n_routed, lay.n_shared, lay.top_k) == (16, 0, 8)


def test_dbrx_layout_reads_ffn_config_and_names_its_fields():
    lay = dbrx_layout(ConfigView({"n_layers": 3, "ffn_config": {"moe_num_experts": 16, "moe_top_k": 4}}))
    assert lay.moe_layers == (0, 1, 2) and (lay.n_routed, lay.n_shared, lay.top_k) == (16, 0, 4)
    assert dbrx_layout(ConfigView({})).moe_layers == tuple(range(24))              # transformers' defaults
    with pytest.raises(InvalidArgument) as e:
        dbrx_layout(ConfigView({"ffn_config": {"moe_num_experts": 4, "moe_top_k": 5}}))
    assert e.value.field == "config.ffn_config.moe_top_k"


def test_lfm2_moe_layers_follow_num_dense_layers():
    lay = lfm2_moe_layout(ConfigView({"num_hidden_layers": 6}))
    assert list(lay.moe_layers) == [2, 3, 4, 5] and (lay.n_routed, lay.n_shared, lay.top_k) == (32, 0, 4)


def test_granitemoe_hybrid_has_experts_and_a_shared_mlp_on_every_layer_by_default():
    """Granite 4.0-H: transformers' defaults (top-2, a shared MLP of 1024) where a config leaves a field out, whatever
    each layer's token mixer, but the layer and expert counts (SGLang's defaults are not transformers'); a dense one
    (no experts) is refused by field."""
    lay = granitemoe_hybrid_layout(ConfigView({"layer_types": ["mamba"] * 32, "num_hidden_layers": 32,
                                               "num_local_experts": 8, "num_experts_per_tok": 2}))
    assert lay.moe_layers == tuple(range(32)) and (lay.n_routed, lay.n_shared, lay.top_k) == (8, 1, 2)
    for field in ("num_hidden_layers", "num_local_experts", "num_experts_per_tok"):
        with pytest.raises(InvalidArgument) as e:
            granitemoe_hybrid_layout(ConfigView({"num_hidden_layers": 4, "num_local_experts": 8,
                                                 "num_experts_per_tok": 2, field: None}))
        assert e.value.field == f"config.{field}"
    lay = granitemoe_hybrid_layout(ConfigView({"num_hidden_layers": 4, "num_local_experts": 64,
                                               "num_experts_per_tok": 6, "shared_intermediate_size": 0}))
    assert lay.moe_layers == (0, 1, 2, 3) and (lay.n_routed, lay.n_shared, lay.top_k) == (64, 0, 6)
    with pytest.raises(InvalidArgument) as e:
        granitemoe_hybrid_layout(ConfigView({"num_hidden_layers": 4, "num_local_experts": 0, "num_experts_per_tok": 2}))
    assert e.value.field == "config.num_local_experts"


# Nemotron 3 Nano's hybrid_override_pattern (52 layers: 23 Mamba2, 23 MoE, 6 attention), as its config.json writes it.
NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"


def test_nemotron_h_moe_layers_are_its_e_blocks_however_its_config_spells_them():
    lay = nemotron_h_layout(ConfigView({"hybrid_override_pattern": NANO_PATTERN, "num_hidden_layers": 52,
                                        "n_routed_experts": 128, "num_experts_per_tok": 6}))
    assert lay.layer_ids == tuple(range(52)) and lay.moe_layers == tuple(i for i, c in enumerate(NANO_PATTERN) if c == "E")
    assert (len(lay.moe_layers), lay.n_routed, lay.n_shared, lay.top_k) == (23, 128, 1, 6)
    kinds = {"M": "mamba", "E": "moe", "*": "attention", "-": "mlp"}
    for spelled in ([kinds[c] for c in "ME*-E"], ["linear_attention", "moe", "full_attention", "mlp", "moe"]):
        assert nemotron_h_layout(ConfigView({"layers_block_type": spelled})).moe_layers == (1, 4)
    with pytest.raises(InvalidArgument) as e:     # transformers' default (M E * -) is not SGLang's
        nemotron_h_layout(ConfigView({}))
    assert e.value.field == "config.layers_block_type"


@pytest.mark.parametrize("fields, field", [
    ({"hybrid_override_pattern": "ME*X"}, "config.hybrid_override_pattern"),
    ({"hybrid_override_pattern": "ME*", "num_hidden_layers": 4}, "config.hybrid_override_pattern"),
    ({"layers_block_type": ["moe", "sliding_attention"]}, "config.layers_block_type"),
    ({"layers_block_type": ["moe"], "n_routed_experts": 4, "num_experts_per_tok": 5}, "config.num_experts_per_tok"),
])
def test_nemotron_h_refuses_a_bad_layout_by_field(fields, field):
    with pytest.raises(InvalidArgument) as e:
        nemotron_h_layout(ConfigView(fields))
    assert e.value.field == field


def test_jamba_moe_layers_follow_the_expert_period_and_offset():
    """Jamba 1.5 Mini's layout (32 layers, 16 experts, every other layer from 1); a bad offset refused by field."""
    lay = jamba_layout(ConfigView({"num_hidden_layers": 32, "num_experts": 16, "num_experts_per_tok": 2,
                                   "expert_layer_period": 2, "expert_layer_offset": 1}))
    assert lay.moe_layers == tuple(range(1, 32, 2)) and (lay.n_routed, lay.n_shared, lay.top_k) == (16, 0, 2)
    assert jamba_layout(ConfigView({"num_hidden_layers": 7, "expert_layer_period": 3,
                                    "expert_layer_offset": 0})).moe_layers == (0, 3, 6)
    with pytest.raises(InvalidArgument) as e:
        jamba_layout(ConfigView({"expert_layer_period": 2, "expert_layer_offset": 2}))
    assert e.value.field == "config.expert_layer_offset"


# SGLang's defaults (0, 0) are not transformers' (1, 1); without num_experts SGLang builds no MoE layer
KIMI_REQUIRED = {"first_k_dense_replace": 1, "num_shared_experts": 1, "num_experts": 256}


@pytest.mark.parametrize("fields,moe,sizes", [
    (KIMI_REQUIRED, [1, 2, 3], (256, 1, 8)),                                    # transformers' defaults
    ({"num_experts": 32, "num_shared_experts": 2, "num_experts_per_token": 4, "first_k_dense_replace": 2}, [2, 3],
     (32, 2, 4)),                                                               # its own names
    ({"num_experts": 16, "n_routed_experts": 16, "num_shared_experts": 0, "n_shared_experts": 0,
      "num_experts_per_tok": 2, "first_k_dense_replace": 1}, [1, 2, 3], (16, 0, 2)),   # DeepSeek's names, agreeing
    ({"num_experts": 32, "n_routed_experts": 32, "num_shared_experts": 1,
      "mlp_layer_types": ["sparse", "dense", "sparse", "dense"]}, [0, 2], (32, 1, 8)),   # the list, as transformers
])
def test_kimi_linear_layers(fields, moe, sizes):
    lay = kimi_linear_layout(ConfigView({"num_hidden_layers": 4, **fields}))
    assert list(lay.moe_layers) == moe and (lay.n_routed, lay.n_shared, lay.top_k) == sizes


@pytest.mark.parametrize("fields,field", [
    ({"num_shared_experts": 1, "num_experts": 8}, "first_k_dense_replace"),     # SGLang: 0, transformers: 1
    ({"first_k_dense_replace": 1, "num_experts": 8}, "num_shared_experts"),     # SGLang: 0, transformers: 1
    ({**KIMI_REQUIRED, "n_routed_experts": 16}, "n_routed_experts"),    # transformers' alias, not SGLang's
    ({"first_k_dense_replace": 1, "num_shared_experts": 1}, "num_experts"),     # SGLang: no MoE layer
    ({**KIMI_REQUIRED, "num_experts": 4, "num_experts_per_token": 5}, "num_experts_per_token"),
    ({**KIMI_REQUIRED, "num_experts": 4, "num_experts_per_tok": 5}, "num_experts_per_tok"),
])
def test_kimi_linear_refuses_by_the_field_it_read(fields, field):
    with pytest.raises(InvalidArgument) as e:
        kimi_linear_layout(ConfigView({"num_hidden_layers": 4, **fields}))
    assert e.value.field == f"config.{field}"


def test_kimi_linear_fields_both_references_read_alike_are_read():
    lay = kimi_linear_layout(ConfigView({"num_hidden_layers": 4, **KIMI_REQUIRED, "moe_layer_freq": 1,
                                         "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"]}))
    assert lay.moe_layers == (1, 2, 3)


@pytest.mark.parametrize("fields,n_layers,sizes", [
    ({}, 28, (512, 0, 12)),                                                     # transformers' defaults
    ({"num_layers": 3, "n_routed_experts": 16, "moe_topk": 4}, 3, (16, 0, 4)),
    ({"n_routed_experts": 8, "zero_expert_num": 4, "moe_topk": 10}, 28, (8, 0, 10)),   # the picks: of both kinds
])
def test_longcat_flash_layers_are_all_moe(fields, n_layers, sizes):
    lay = longcat_flash_layout(ConfigView(fields))
    assert lay.layer_ids == lay.moe_layers == tuple(range(n_layers))
    assert (lay.n_routed, lay.n_shared, lay.top_k) == sizes


@pytest.mark.parametrize("fields,field", [({"n_routed_experts": 8, "zero_expert_num": 4, "moe_topk": 13}, "moe_topk"),
                                          ({"num_hidden_layers": 6}, "num_layers")])   # sublayers or layers?
def test_longcat_flash_refuses_by_field(fields, field):
    with pytest.raises(InvalidArgument) as e:
        longcat_flash_layout(ConfigView(fields))
    assert e.value.field == f"config.{field}"


@pytest.mark.parametrize("fields,sizes", [({}, (128, 1, 8)),
                                          ({"num_local_experts": 16, "n_shared_experts": 0}, (16, 0, 8)),
                                          ({"n_routed_experts": 32, "num_experts_per_tok": 4}, (32, 1, 4))])
def test_solar_open_layers_are_all_moe(fields, sizes):
    lay = solar_open_layout(ConfigView({"num_hidden_layers": 3, **fields}))
    assert lay.layer_ids == lay.moe_layers == (0, 1, 2) and (lay.n_routed, lay.n_shared, lay.top_k) == sizes


@pytest.mark.parametrize("fields,moe,sizes", [({}, list(range(2, 42)), (512, 1, 8)),    # transformers' defaults
                                              ({"num_hidden_layers": 4, "num_experts": 16, "first_k_dense_replace": 1},
                                               [1, 2, 3], (16, 1, 8))])
def test_bailing_hybrid_layers(fields, moe, sizes):
    lay = bailing_hybrid_layout(ConfigView(fields))
    assert list(lay.moe_layers) == moe and (lay.n_routed, lay.n_shared, lay.top_k) == sizes


def test_exaone_moe_refuses_a_bad_mlp_layer_types_by_field():
    with pytest.raises(InvalidArgument) as e:
        exaone_moe_layout(ConfigView({"num_hidden_layers": 4, "mlp_layer_types": ["sparse"] * 3}))
    assert e.value.field == "config.mlp_layer_types"


@pytest.mark.parametrize("fields,want", [
    ({"num_experts": 2}, (2, 1, 1)),                                            # transformers' defaults
    ({"num_experts": 64, "moe_topk": 8, "num_shared_expert": 1}, (64, 1, 8)),
    ({"num_experts": [16] * 4, "moe_topk": [4] * 4, "num_shared_expert": [1] * 4}, (16, 1, 4)),   # per layer
])
def test_hunyuan_every_layer_moe_with_per_layer_fields(fields, want):
    lay = hunyuan_v1_moe_layout(ConfigView({"num_hidden_layers": 4, **fields}))
    assert lay.moe_layers == (0, 1, 2, 3) and (lay.n_routed, lay.n_shared, lay.top_k) == want


@pytest.mark.parametrize("fields,field", [({"num_shared_expert": [0] * 4}, "num_shared_expert"),
                                          ({"num_shared_expert": 2}, "num_shared_expert"),
                                          ({"use_mixed_mlp_moe": False}, "use_mixed_mlp_moe")])
def test_hunyuan_refuses_a_shared_mlp_its_references_build_two_ways(fields, field):
    # transformers builds one shared MLP of intermediate_size whatever these say; SGLang num_shared_expert times as
    # wide, and none without use_mixed_mlp_moe
    with pytest.raises(InvalidArgument) as e:
        hunyuan_v1_moe_layout(ConfigView({"num_hidden_layers": 4, "num_experts": 8, **fields}))
    assert e.value.field == f"config.{field}"


@pytest.mark.parametrize("fields,field,why", [
    ({"moe_topk": [8, 8, 8, 4]}, "moe_topk", "differ"),
    ({"moe_topk": [8, 8]}, "moe_topk", "one value per layer (4), got 2"),
    ({"num_experts": 8, "moe_topk": 9}, "moe_topk", "exceeds"),
    ({"num_experts": [1] * 4}, "num_experts", "must be >= 2"),             # SGLang: a dense MLP
    ({"num_experts": None}, "num_experts", "missing"),                     # transformers' 1: see above
    ({"moe_topk": 2, "num_experts_per_tok": 4}, "num_experts_per_tok", "two names"),
    ({"num_shared_expert": [1, 1, 1, "1"]}, "num_shared_expert", "list of integers"),
])
def test_hunyuan_refusals_name_the_field(fields, field, why):
    with pytest.raises(InvalidArgument) as e:
        hunyuan_v1_moe_layout(ConfigView({"num_hidden_layers": 4, "num_experts": 8, **fields}))
    assert e.value.field == f"config.{field}" and why in str(e.value)


@pytest.mark.parametrize("layout,cfg", [(deepseek_layout, deepseek(num_experts_per_tok=257)),
                                        (deepseek_nextn_layout, deepseek(num_experts_per_tok=300)),
                                        (lambda c: qwen_moe_layout(c, shared=False), qwen3(num_experts_per_tok=129))])
def test_top_k_above_the_experts(layout, cfg):
    with pytest.raises(InvalidArgument) as e:
        layout(ConfigView(cfg))
    assert e.value.field == "config.num_experts_per_tok"
    assert "exceeds" in str(e.value)


@pytest.mark.parametrize("bad", ["[1]", [1, "2"], [True], 3])
def test_mlp_only_layers_must_be_integers(bad):
    with pytest.raises(InvalidArgument) as e:
        qwen_moe_layout(ConfigView(qwen3(mlp_only_layers=bad)), shared=False)
    assert e.value.field == "config.mlp_only_layers"


@pytest.mark.parametrize("field,value", [("num_hidden_layers", 0), ("n_routed_experts", 0),
                                         ("num_experts_per_tok", 0), ("n_shared_experts", -1),
                                         ("first_k_dense_replace", -1), ("moe_layer_freq", 0)])
def test_deepseek_minimums(field, value):
    with pytest.raises(InvalidArgument) as e:
        deepseek_layout(ConfigView(deepseek(**{field: value})))
    assert e.value.field == f"config.{field}"
    assert ">=" in str(e.value)


def test_qwen_expert_count_under_its_config_classes_names():
    # transformers' Qwen3MoeConfig writes num_local_experts and reads num_experts as it; Qwen2-MoE's, Qwen3-Next's and
    # Qwen3.5's read num_experts alone (SGLang too)
    cfg = qwen3()
    cfg["num_local_experts"] = cfg.pop("num_experts")
    assert entries.FAMILIES["qwen3_moe"].layout(ConfigView(cfg)).n_routed == 128
    with pytest.raises(InvalidArgument) as e:
        entries.FAMILIES["qwen3_moe"].layout(ConfigView(qwen3(num_local_experts=7)))    # two names disagree
    assert e.value.field == "config.num_local_experts"
    only_alias = qwen2()
    only_alias["num_local_experts"] = only_alias.pop("num_experts")
    with pytest.raises(InvalidArgument) as e:
        entries.FAMILIES["qwen2_moe"].layout(ConfigView(only_alias))
    assert e.value.field == "config.num_experts"


def test_mixtral_every_layer_is_moe_with_its_local_experts():
    lay = every_layer_moe_layout(ConfigView(mixtral(num_hidden_layers=5, num_local_experts=16, num_experts_per_tok=4)),
                                 "num_local_experts")
    assert lay.layer_ids == lay.moe_layers == (0, 1, 2, 3, 4)
    assert (lay.n_routed, lay.n_shared, lay.top_k) == (16, 0, 4)


def test_olmoe_reads_num_experts_and_its_alias():
    lay = entries.FAMILIES["olmoe"].layout(ConfigView({"num_hidden_layers": 3, "num_local_experts": 64,
                                                       "num_experts_per_tok": 8}))
    assert lay.moe_layers == (0, 1, 2) and (lay.n_routed, lay.top_k) == (64, 8)
    with pytest.raises(InvalidArgument) as e:      # transformers' OlmoeConfig reads the alias over num_experts
        entries.FAMILIES["olmoe"].layout(ConfigView({"num_hidden_layers": 3, "num_experts": 64,
                                                     "num_experts_per_tok": 8, "num_local_experts": 7}))
    assert e.value.field == "config.num_local_experts"


@pytest.mark.parametrize("over, moe", [({"interleave_moe_layer_step": 2}, (1, 3, 5)),
                                       ({}, (0, 1, 2, 3, 4, 5)),
                                       ({"moe_layers": [5, 1, 3], "interleave_moe_layer_step": 2}, (1, 3, 5))])
def test_llama4_moe_layers_are_listed_or_interleaved_each_with_a_shared_expert(over, moe):
    cfg = {"num_hidden_layers": 6, "num_local_experts": 16, **over}
    lay = entries.FAMILIES["llama4"].layout(ConfigView(cfg))
    assert lay.moe_layers == moe and (lay.n_routed, lay.n_shared, lay.top_k) == (16, 1, 1)   # top-1 by default


def test_llama4_moe_layers_out_of_range_are_named():
    with pytest.raises(InvalidArgument) as e:
        entries.FAMILIES["llama4"].layout(ConfigView({"num_hidden_layers": 6, "num_local_experts": 16,
                                                      "moe_layers": [2, 6]}))
    assert e.value.field == "config.moe_layers"


def test_glm4_moe_lite_reads_its_layer_list():
    fam = entries.FAMILIES["glm4_moe_lite"]
    lay = fam.layout(ConfigView({"num_hidden_layers": 4, "n_routed_experts": 64}))
    assert lay.moe_layers == (1, 2, 3) and (lay.n_routed, lay.n_shared, lay.top_k) == (64, 1, 4)   # its defaults
    lay = fam.layout(ConfigView({"num_hidden_layers": 3, "n_routed_experts": 64,
                                 "mlp_layer_types": ["sparse", "dense", "sparse"]}))
    assert lay.moe_layers == (0, 2)
    with pytest.raises(InvalidArgument) as e:
        fam.layout(ConfigView({"num_hidden_layers": 3, "n_routed_experts": 64, "mlp_layer_types": ["sparse"]}))
    assert e.value.field == "config.mlp_layer_types"


def test_glm4_moe_lite_nextn_draft_reads_the_targets_fields_as_glm_lite_does():
    # transformers' Glm4MoeLiteConfig leaves n_shared_experts out at one shared expert (DeepSeek's draft reader,
    # which the GLM-4.7-Flash draft used, said none)
    lay = entries.FAMILIES["glm4_moe_lite_nextn"].layout(ConfigView({"num_hidden_layers": 47, "n_routed_experts": 64,
                                                                     "num_nextn_predict_layers": 1}))
    assert lay.layer_ids == lay.moe_layers == (47,) and (lay.n_routed, lay.n_shared, lay.top_k) == (64, 1, 4)


def test_qwen3_5_moe_makes_every_layer_moe_whatever_the_fields_it_does_not_read_say():
    # transformers' and SGLang's Qwen3.5-MoE read neither decoder_sparse_step nor mlp_only_layers
    cfg = qwen2(architectures=["Qwen3_5MoeForCausalLM"], decoder_sparse_step=2, mlp_only_layers=[0])
    lay = entries.FAMILIES["qwen3_5_moe"].layout(ConfigView(cfg))
    assert lay.moe_layers == lay.layer_ids == tuple(range(cfg["num_hidden_layers"])) and lay.n_shared == 1
    assert entries.FAMILIES["qwen3_next"].layout(ConfigView(cfg)).moe_layers == (1, 3)   # transformers reads them
    with pytest.raises(InvalidArgument) as e:   # a dense Qwen3.5's text config
        entries.FAMILIES["qwen3_5_moe"].layout(ConfigView(dict(cfg, model_type="qwen3_5_text")))
    assert e.value.field == "config.model_type"


def test_deepseek_v4_makes_every_layer_moe_whatever_first_k_dense_replace_says():
    # SGLang's models/deepseek_v4.py builds DeepSeek-V2's MoE block on every layer (its first n_hash_layers hash-routed)
    cfg = deepseek(architectures=["DeepseekV4ForCausalLM"], first_k_dense_replace=1, moe_layer_freq=2,
                   num_experts_per_tok=6)
    lay = entries.FAMILIES["deepseek_v4"].layout(ConfigView(cfg))
    assert lay.moe_layers == lay.layer_ids == (0, 1, 2, 3) and (lay.n_routed, lay.n_shared, lay.top_k) == (256, 1, 6)
    del cfg["n_shared_experts"]
    assert entries.FAMILIES["deepseek_v4"].layout(ConfigView(cfg)).n_shared == 1          # SGLang's default


def test_dots3_reads_deepseeks_fields_with_sglangs_defaults():
    lay = entries.FAMILIES["dots3"].layout(ConfigView({"num_hidden_layers": 4}))
    assert lay.moe_layers == (1, 2, 3) and (lay.n_routed, lay.n_shared, lay.top_k) == (128, 1, 6)


def test_minimax_m2_reads_num_local_experts():
    lay = entries.FAMILIES["minimax_m2"].layout(ConfigView({"num_hidden_layers": 62, "num_local_experts": 256,
                                                            "num_experts_per_tok": 8}))
    assert lay.moe_layers == tuple(range(62)) and (lay.n_routed, lay.n_shared, lay.top_k) == (256, 0, 8)


def test_gpt_oss_reads_num_local_experts():
    lay = entries.FAMILIES["gpt_oss"].layout(ConfigView({"num_hidden_layers": 4, "num_local_experts": 32,
                                                         "num_experts_per_tok": 4}))
    assert lay.layer_ids == lay.moe_layers == (0, 1, 2, 3) and (lay.n_routed, lay.n_shared, lay.top_k) == (32, 0, 4)
    with pytest.raises(InvalidArgument) as e:      # transformers' GptOssConfig reads num_experts as num_local_experts
        entries.FAMILIES["gpt_oss"].layout(ConfigView({"num_hidden_layers": 4, "num_local_experts": 32,
                                                       "num_experts_per_tok": 4, "num_experts": 7}))
    assert e.value.field == "config.num_experts"


@pytest.mark.parametrize("field,over", [("num_local_experts", {"num_local_experts": None}),
                                        ("num_local_experts", {"num_local_experts": 0}),
                                        ("num_experts_per_tok", {"num_experts_per_tok": 9}),
                                        ("num_hidden_layers", {"num_hidden_layers": "32"})])
def test_mixtral_bad_fields_are_named(field, over):
    cfg = mixtral(**over)
    if over.get(field, 0) is None:
        del cfg[field]
    with pytest.raises(InvalidArgument) as e:
        entries.FAMILIES["mixtral"].layout(ConfigView(cfg))
    assert e.value.field == f"config.{field}"


def test_glm4_moe_layout_has_glm_defaults_the_engine_builds_too():
    """One reader: the engine's GLM-4-MoE and DeepSeek configs take their layer and expert fields from these readers,
    so a config that leaves first_k_dense_replace / n_shared_experts out gets GLM's defaults in both (before, the
    registry read DeepSeek's: layer 0 MoE, no shared expert, while the engine built layer 0 dense with one)."""
    from loadplan.engine.models.glm4_moe import Glm4MoeConfig
    from loadplan.layouts import glm4_moe_layout

    cfg = {"num_hidden_layers": 3, "num_local_experts": 8, "num_experts_per_tok": 2}
    lay = entries.FAMILIES["glm4_moe"].layout(ConfigView(cfg))
    assert lay == glm4_moe_layout(ConfigView(cfg))
    assert (lay.moe_layers, lay.n_routed, lay.n_shared) == ((1, 2), 8, 1)
    engine = Glm4MoeConfig.from_hf({**cfg, "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
                                    "moe_intermediate_size": 8, "num_attention_heads": 2})
    assert (engine.moe_layers, engine.n_routed_experts, engine.n_shared_experts) == (lay.moe_layers, 8, 1)
