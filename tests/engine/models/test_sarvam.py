"""Sarvam's MoE models (`SarvamMLAForCausalLM`: sarvam-105b; `SarvamMoEForCausalLM`: sarvam-30b) from checkpoints
written as theirs are (Sarvam's config.json names; sarvam-30b's Bailing tensor names, q/k/v fused): logits and greedy
tokens against transformers in float32, whose AutoModelForCausalLM reads the same config.json (DeepSeek-V3 and
GLM-4-MoE built from SarvamMLAConfig / SarvamMoEConfig); the Hub's older fields (head_dim as the MLA cache width,
"deepseek_yarn"); the defaults a config leaves out (sarvam-30b's rope theta and whole-head rotation); token-by-token
decoding; a batch decodes each row as alone; the registry plans their shared experts, never fused (not the fused
architectures); a field given under both names, differently, is refused. EP 2 with every backend and TP 2:
tests/engine/parallel/."""

from __future__ import annotations

import pytest

from loadplan.engine.models.config import ConfigError
from loadplan.plan import Keys

from engine_helpers import (DROP, check_batch_rows_decode_alone, check_decoding_token_by_token,
                            check_matches_transformers, check_refused_before_any_plan, make_sarvam_checkpoint,
                            with_config)

AUTO = "AutoModelForCausalLM"      # transformers' class for both: it reads model_type


@pytest.fixture(scope="module", params=["MLA", "MoE"])
def ckpt(request, tmp_path_factory):
    return request.param, make_sarvam_checkpoint(tmp_path_factory.mktemp(f"sarvam_{request.param}"), request.param)


def test_logits_and_greedy_tokens_match_transformers(ckpt, ids):
    family, path = ckpt
    model = check_matches_transformers(path, AUTO, ids)
    d = model.plan.decisions
    assert d[Keys.ENTRY_FAMILY].value == f"sarvam_{family.lower()}"
    assert d[Keys.SHARED_EXPERTS_FUSION].value is False
    assert d[Keys.SHARED_EXPERTS_FUSION].rule == \
        ("deepseek" if family == "MLA" else "glm4_moe") + ".structural.architecture"
    assert model.moe_layer_ids == (1, 2)                    # the first layer dense, as Sarvam's configs default
    if family == "MoE":
        attn = model.model.layers[0].self_attn
        assert attn.q_proj.bias is not None and attn.q_norm is not None and attn.rotary_dim == 8


@pytest.mark.parametrize("family, hub", [
    # sarvam-105b's config.json: head_dim as its MLA cache width (kv_lora_rank + qk_rope_head_dim), q_head_dim,
    # rope_scaling's "deepseek_yarn" (YaRN)
    ("MLA", dict(head_dim=24, q_head_dim=16, rope_parameters=DROP, rope_theta=10000.0,
                 rope_scaling={"type": "deepseek_yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                               "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})),
    # sarvam-30b's defaults where its config.json says nothing: rope theta 8e6, whole heads rotated
    ("MoE", dict(rope_parameters=DROP)),
])
def test_the_hubs_fields_and_defaults_read_as_transformers_reads_them(tmp_path, ids, family, hub):
    check_matches_transformers(make_sarvam_checkpoint(tmp_path / "s", family, seed=1, hub=hub), AUTO, ids)


def test_decoding_token_by_token_gives_transformers_logits_of_the_whole_prompt(ckpt, ids):
    check_decoding_token_by_token(ckpt[1], AUTO, ids)


def test_a_batch_decodes_each_row_as_alone(ckpt, ids):
    check_batch_rows_decode_alone(ckpt[1], ids)


def test_a_field_under_both_its_names_differently_is_refused_before_any_plan(ckpt, tmp_path):
    family, path = ckpt
    bias = family == "MoE"                                  # the checkpoint's use_qkv_bias
    check_refused_before_any_plan(with_config(path, tmp_path / "bad", attention_bias=not bias), ConfigError,
                                  rf"config\.use_qkv_bias: {bias} disagrees with attention_bias={not bias} "
                                  rf"\(the same field\)")
