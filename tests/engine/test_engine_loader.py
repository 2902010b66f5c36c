"""load_model: the plan drives the build, weights load by it, errors name the tensor, other load paths."""

from __future__ import annotations

import dataclasses
import json
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

from loadplan.engine import loader
from loadplan.engine.loader import load_model
from loadplan.engine.models import PPMissingLayer
from loadplan.engine.weights import LayoutMismatch, MissingTensor, UnexpectedTensor
from loadplan.plan import Keys, Parallel, Runtime

from engine_helpers import LocalRegistry, hf_logits, make_checkpoint, prompt

UNFUSED = Runtime(disable_shared_experts_fusion=True)
EPLB = Runtime(enable_eplb=True)

QWEN2 = "Qwen2MoeForCausalLM"


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """A 3-layer Qwen2-MoE checkpoint whose shared expert can be fused, and transformers' logits on it."""
    path = make_checkpoint(tmp_path_factory.mktemp("qwen2"), QWEN2, num_hidden_layers=3)
    ids = prompt()
    return path, ids, hf_logits(path, QWEN2, ids)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids)


def _rewrite(src, dst, edit):
    """Copy checkpoint folder src to dst with its tensors passed through edit(dict) -> dict."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = edit(load_file(src / "model.safetensors"))
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_a_prefused_checkpoint_loads_fused_and_is_refused_unfused(qwen2, tmp_path):
    path, ids, want = qwen2

    def prefuse(t):
        return {k.replace("mlp.shared_expert.", "mlp.experts.8."): v for k, v in t.items()}

    prefused = _rewrite(path, tmp_path / "prefused", prefuse)
    got = _logits(load_model(prefused, registry=LocalRegistry()), ids)
    assert (got - want).abs().max().item() <= 1e-3
    with pytest.raises(LayoutMismatch, match=r"model\.layers\.\d\.mlp\.experts\.8\..*fused layout"):
        load_model(prefused, registry=LocalRegistry(), runtime=UNFUSED)


def test_missing_and_unexpected_tensors_are_named(qwen2, tmp_path):
    path, _, _ = qwen2
    gone = "model.layers.2.mlp.experts.5.up_proj.weight"
    missing = _rewrite(path, tmp_path / "missing", lambda t: {k: v for k, v in t.items() if k != gone})
    for fused in (True, False):
        with pytest.raises(MissingTensor, match=gone.replace(".", r"\.")):
            load_model(missing, registry=LocalRegistry(), runtime=Runtime(disable_shared_experts_fusion=not fused))
    gone = "model.layers.1.mlp.shared_expert.down_proj.weight"
    missing = _rewrite(path, tmp_path / "missing_shared", lambda t: {k: v for k, v in t.items() if k != gone})
    with pytest.raises(MissingTensor, match=r"model\.layers\.1\.mlp\.shared_expert\(s\)\.down_proj"):
        load_model(missing, registry=LocalRegistry())
    extra = "model.layers.0.mlp.bonus.weight"
    unexpected = _rewrite(path, tmp_path / "unexpected", lambda t: {**t, extra: torch.zeros(3)})
    with pytest.raises(UnexpectedTensor, match=extra.replace(".", r"\.")):
        load_model(unexpected, registry=LocalRegistry())


def test_eplb_descriptor_covers_the_moe_layers_without_the_fused_slot(qwen2):
    path, _, _ = qwen2
    model = load_model(path, registry=LocalRegistry(), runtime=EPLB)
    desc = model.routed_experts_weights_of_layer
    assert list(desc) == model.plan.decisions[Keys.EPLB_LAYERS].value == [0, 1, 2]
    gate_up, down = desc[1]
    experts = model.model.layers[1].mlp.experts
    assert experts.num_fused_shared_experts == 1
    assert gate_up.shape == (8, 64, 64) and down.shape == (8, 64, 32)       # 8 routed, not the 9th slot
    assert gate_up.data_ptr() == experts.gate_up_proj.data_ptr()            # the loaded tensors, not meta
    assert not gate_up.is_meta


def test_weight_cache_bypasses_load_weights_and_keeps_the_descriptor(qwen2, tmp_path, monkeypatch):
    path, ids, want = qwen2
    cache = tmp_path / "qwen2.cache"      # a real deployment puts it under /dev/shm
    first = load_model(path, registry=LocalRegistry(), weight_cache=cache)
    assert cache.is_file()

    def refuse(*a, **k):
        raise AssertionError("the cache path must not read the checkpoint")

    monkeypatch.setattr(loader, "load_weights", refuse)
    monkeypatch.setattr(loader, "Checkpoint", refuse)
    second = load_model(path, registry=LocalRegistry(), weight_cache=cache)
    torch.testing.assert_close(_logits(second, ids), _logits(first, ids), atol=0, rtol=0)
    assert (_logits(second, ids) - want).abs().max().item() <= 1e-3
    desc = second.routed_experts_weights_of_layer
    assert list(desc) == [0, 1, 2]
    assert desc[0][0].data_ptr() == second.model.layers[0].mlp.experts.gate_up_proj.data_ptr()
    assert not any(t.is_meta for t in desc[2])
    # a cache made for the fused layout is not assigned into an unfused model
    with pytest.raises(LayoutMismatch, match="num_fused_shared: cache 1 vs model 0"):
        load_model(path, registry=LocalRegistry(), runtime=UNFUSED, weight_cache=cache)
    # nor the reverse
    monkeypatch.undo()
    unfused_cache = tmp_path / "qwen2-unfused.cache"
    load_model(path, registry=LocalRegistry(), runtime=UNFUSED, weight_cache=unfused_cache)
    with pytest.raises(LayoutMismatch, match="num_fused_shared: cache 0 vs model 1"):
        load_model(path, registry=LocalRegistry(), weight_cache=unfused_cache)


def test_pipeline_stages_hold_their_layers_and_chain_to_the_full_logits(qwen2):
    path, ids, want = qwen2
    s0 = load_model(path, Parallel(pp_size=2, pp_rank=0), EPLB, registry=LocalRegistry())
    s1 = load_model(path, Parallel(pp_size=2, pp_rank=1), EPLB, registry=LocalRegistry())
    assert s0.layer_range == (0, 2) and s1.layer_range == (2, 3)
    assert isinstance(s0.model.layers[2], PPMissingLayer) and not hasattr(s0.model.layers[2], "mlp")
    assert isinstance(s1.model.layers[0], PPMissingLayer) and isinstance(s1.model.layers[1], PPMissingLayer)
    assert s0.model.embed_tokens is not None and s0.model.norm is None and s0.lm_head is None
    assert s1.model.embed_tokens is None and s1.model.norm is not None and s1.lm_head is not None
    assert list(s0.routed_experts_weights_of_layer) == [0, 1]    # global ids, local layers only
    assert list(s1.routed_experts_weights_of_layer) == [2]
    with torch.no_grad():
        got = s1(hidden_states=s0(ids))
    assert (got - want).abs().max().item() <= 1e-3


class _ThreadAllReduce:
    """A fake collective for ranks running as threads of one process: every rank gets the sum."""

    def __init__(self, n):
        self.n, self.parts = n, [None] * n
        self.barrier = threading.Barrier(n, timeout=60)   # a failing rank breaks it, never hangs

    def for_rank(self, rank):
        def reduce(x):
            self.parts[rank] = x
            self.barrier.wait()
            total = sum(self.parts)
            self.barrier.wait()
            return total
        return reduce


def test_expert_parallel_ranks_with_the_planned_all_reduce_give_the_reference_logits(qwen2):
    path, ids, want = qwen2
    ranks = [load_model(path, Parallel(ep_size=2, ep_rank=r), registry=LocalRegistry(), deployment="ep2")
             for r in range(2)]
    assert all(m.plan.decisions[Keys.POST_EXPERTS_ALL_REDUCE].value for m in ranks)
    assert all(m.plan.decisions[Keys.FUSED_SHARED_EXPERT_SCALE].value == 0.5 for m in ranks)
    ar = _ThreadAllReduce(2)
    for r, m in enumerate(ranks):
        for i in m.moe_layer_ids:
            m.model.layers[i].mlp.experts.reduce = ar.for_rank(r)
    out = [None, None]
    threads = [threading.Thread(target=lambda r=r: out.__setitem__(r, _logits(ranks[r], ids)), daemon=True)
               for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(o is not None for o in out), "a rank failed (see the thread's traceback above)"
    for got in out:
        assert (got - want).abs().max().item() <= 1e-3


class _TamperingRegistry(LocalRegistry):
    """Returns a plan with one decision changed: the engine must follow it (and so go wrong)."""

    def __init__(self, key, value):
        super().__init__()
        self.key, self.value = key, value

    def resolve_load_plan(self, request):
        plan = super().resolve_load_plan(request)
        d = dict(plan.decisions)
        d[self.key] = dataclasses.replace(d[self.key], value=self.value)
        return dataclasses.replace(plan, decisions=d)


def test_a_wrong_decision_gives_wrong_logits_that_the_reference_catches(qwen2):
    path, ids, want = qwen2
    model = load_model(path, registry=_TamperingRegistry(Keys.FUSED_SHARED_EXPERT_SCALE, 0.5))
    assert (_logits(model, ids) - want).abs().max().item() > 1e-2


def test_the_real_registry_records_the_plan(qwen2, tmp_path):
    from loadplan.service.embedded import EmbeddedRegistry

    path, ids, want = qwen2
    with EmbeddedRegistry(f"sqlite:///{tmp_path / 'registry.db'}") as reg:
        with reg.client() as client:      # a RegistryClient
            model = load_model(path, registry=client, request_id="req-1", deployment="dep-1")
            assert (_logits(model, ids) - want).abs().max().item() <= 1e-3
            stored = client.get_plan(model.plan.plan_id)
        assert stored.decisions[Keys.SHARED_EXPERTS_FUSION].value is True
        # a registry address (str): the same request id replays the stored plan
        again = load_model(path, registry=reg.address, request_id="req-1", deployment="dep-1")
        assert again.plan.plan_id == model.plan.plan_id and again.plan.replayed


def test_quantized_checkpoints_are_refused_after_the_plan(qwen2, tmp_path):
    path, _, _ = qwen2
    q = tmp_path / "q"
    q.mkdir()
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes"}
    (q / "config.json").write_text(json.dumps(cfg))
    reg = LocalRegistry()
    with pytest.raises(NotImplementedError, match=r"quantization 'bitsandbytes' not supported by the engine; "
                                                  r"supported: none \(unquantized checkpoints\), fp8, "
                                                  r"compressed_tensors, mxfp4, gptq, awq"):
        load_model(q, registry=reg)
    assert reg.requests[0].quantization_config == {"quant_method": "bitsandbytes"}


# --- a config the family cannot run is refused before the plan ------------------------------------

_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
# (entry class, transformers config class, its kwargs, the bad field and value, role)
_BAD_CONFIGS = [
    ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(num_experts=8, moe_intermediate_size=16),
     {"use_sliding_window": True}, "target"),
    ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(num_experts=8, moe_intermediate_size=16),
     {"decoder_sparse_step": 0}, "target"),
    ("MixtralForCausalLM", "MixtralConfig", dict(num_local_experts=8), {"sliding_window": -2}, "target"),
    ("OlmoeForCausalLM", "OlmoeConfig", dict(num_experts=8), {"clip_qkv": -1.0}, "target"),
    ("GptOssForCausalLM", "GptOssConfig", dict(num_local_experts=8), {"layer_types": ["chunked_attention"]},
     "target"),
    ("MiniMaxM2ForCausalLM", "MiniMaxM2Config", dict(num_local_experts=8), {"scoring_func": "softmax"}, "target"),
    ("GraniteMoeForCausalLM", "GraniteMoeConfig", dict(num_local_experts=8), {"logits_scaling": 0}, "target"),
    ("GraniteMoeSharedForCausalLM", "GraniteMoeSharedConfig", dict(num_local_experts=8, shared_intermediate_size=16),
     {"shared_intermediate_size": -1}, "target"),
    ("HunYuanMoEV1ForCausalLM", "HunYuanMoEV1Config", dict(num_experts=8, moe_topk=2, head_dim=8), {"use_cla": True},
     "target"),
    ("AfmoeForCausalLM", "AfmoeConfig", dict(num_experts=8, moe_intermediate_size=16, num_experts_per_tok=2,
                                             head_dim=12), {"n_group": 2}, "target"),
    ("DbrxForCausalLM", None, {}, {"n_heads": 5}, "target"),
    ("MiMoV2FlashForCausalLM", "MiMoV2FlashConfig", dict(n_routed_experts=8, moe_intermediate_size=16, head_dim=8,
                                                         v_head_dim=8, num_experts_per_tok=2), {"sliding_window": 0},
     "target"),
    ("Lfm2MoeForCausalLM", "Lfm2MoeConfig", dict(num_experts=8, moe_intermediate_size=16, num_experts_per_tok=2,
                                                 layer_types=["conv", "full_attention"]), {"conv_L_cache": 0},
     "target"),
    ("FlexOlmoForCausalLM", "FlexOlmoConfig", dict(num_experts=8, pad_token_id=0, eos_token_id=1),
     {"clip_qkv": 8.0}, "target"),
    ("ExaoneMoeForCausalLM", "ExaoneMoeConfig", dict(num_experts=8, moe_intermediate_size=16, num_experts_per_tok=2),
     {"mlp_layer_types": ["dense"]}, "target"),
    ("PhimoeForCausalLM", "PhimoeConfig", dict(num_local_experts=8), {"num_experts_per_tok": 1}, "target"),
    ("PhiMoEForCausalLM", "PhimoeConfig", dict(num_local_experts=8), {"router_jitter_noise": -1.0}, "target"),
    ("GraniteMoeSWAForCausalLM", "GraniteMoeSWAConfig", dict(num_local_experts=8), {"sliding_window": 0}, "target"),
    ("GraniteMoeHybridForCausalLM", "GraniteMoeHybridConfig", dict(num_local_experts=8, mamba_n_heads=4),
     {"mamba_n_groups": 3}, "target"),
    ("MiniMaxForCausalLM", "MiniMaxConfig", dict(num_local_experts=8, num_experts_per_tok=2), {"sliding_window": 8},
     "target"),
    ("JambaForCausalLM", "JambaConfig", dict(num_experts=8, attn_layer_period=2, attn_layer_offset=1),
     {"attn_layer_offset": 2}, "target"),
    ("KimiLinearForCausalLM", "KimiLinearConfig", dict(num_local_experts=8, moe_intermediate_size=16,
                                                       num_experts_per_tok=2, kv_lora_rank=16, qk_rope_head_dim=8,
                                                       qk_nope_head_dim=8, v_head_dim=8, linear_head_dim=8,
                                                       linear_num_heads=4, pad_token_id=0, bos_token_id=1,
                                                       eos_token_id=2), {"mla_use_nope": False}, "target"),
    ("LongcatFlashForCausalLM", "LongcatFlashConfig", dict(n_routed_experts=8, zero_expert_num=4, moe_topk=2,
                                                           expert_ffn_hidden_size=16, q_lora_rank=16, kv_lora_rank=16,
                                                           pad_token_id=0), {"router_bias": True}, "target"),
    ("BailingHybridForCausalLM", "BailingHybridConfig", dict(num_local_experts=8, moe_intermediate_size=16,
                                                             num_experts_per_tok=2, n_group=1, topk_group=1,
                                                             kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                                             v_head_dim=8, head_dim=8, pad_token_id=0, eos_token_id=2),
     {"layer_group_size": 0}, "target"),
    ("Cohere2MoeForCausalLM", "Cohere2MoeConfig", dict(num_experts=8, head_dim=8, pad_token_id=0, bos_token_id=1,
                                                       eos_token_id=2), {"expert_selection_fn": "relu"}, "target"),
    ("Step3p5ForCausalLM", "Step3p7TextConfig", dict(n_routed_experts=8, num_experts_per_tok=2, head_dim=8,
                                                    pad_token_id=0), {"gating": False}, "target"),
    ("Step3p7ForConditionalGeneration", None, {}, {"text_config": None}, "target"),
    ("SarvamMLAForCausalLM", "SarvamMLAConfig", dict(n_routed_experts=8, moe_intermediate_size=16, kv_lora_rank=16,
                                                     qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
     {"scoring_func": "softmax"}, "target"),
    ("HYV3ForCausalLM", "HYV3Config", dict(num_experts=8, moe_intermediate_size=16, num_experts_per_tok=2),
     {"mlp_bias": True}, "target"),
    ("LagunaForCausalLM", "LagunaConfig", dict(num_experts=8, num_experts_per_tok=2, head_dim=8),
     {"gating": "per-group"}, "target"),
    ("AXK1ForCausalLM", "AXK1Config", dict(n_routed_experts=8, moe_intermediate_size=16, kv_lora_rank=16,
                                           q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                                           n_group=1, topk_group=1, bos_token_id=0, eos_token_id=1),
     {"moe_layer_freq": 0}, "target"),
    ("FlintForCausalLM", "FlintConfig", dict(num_experts=8, num_experts_per_tok=2, head_dim=8, mlp_only_layers=[0]),
     {"decoder_sparse_step": 0}, "target"),
    ("Kolibri1ForCausalLM", "Kolibri1Config", dict(num_experts=8, num_experts_per_tok=2, head_dim=8),
     {"sliding_window": 0}, "target"),
    ("MellumForCausalLM", "MellumConfig", dict(num_experts=8, num_experts_per_tok=2, head_dim=8), {"sliding_window": 0},
     "target"),
    ("Mistral4ForCausalLM", "Mistral4Config", dict(n_routed_experts=8, moe_intermediate_size=16, kv_lora_rank=16,
                                                   qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
     {"num_experts_per_tok": 0}, "target"),
    ("SarvamMoEForCausalLM", "SarvamMoEConfig", dict(n_routed_experts=8, moe_intermediate_size=16, head_dim=8),
     {"moe_layer_freq": 2}, "target"),
    ("SolarOpenForCausalLM", "SolarOpenConfig", dict(n_routed_experts=8, moe_intermediate_size=16,
                                                     num_experts_per_tok=2), {"use_qk_norm": True}, "target"),
    ("NemotronHForCausalLM", "NemotronHConfig", dict(n_routed_experts=8, mamba_num_heads=4),
     {"moe_latent_size": 0}, "target"),
    ("Llama4ForCausalLM", "Llama4TextConfig", dict(num_local_experts=4), {"attention_chunk_size": 0}, "target"),
    ("Llama4ForConditionalGeneration", None, {}, {"text_config": None}, "target"),
    ("Qwen3VLMoeForConditionalGeneration", None, {}, {"text_config": None}, "target"),
    ("Glm4vMoeForConditionalGeneration", None, {}, {"text_config": None}, "target"),
    ("Glm4MoeLiteForCausalLM", "Glm4MoeLiteConfig", dict(n_routed_experts=16, moe_intermediate_size=16),
     {"mlp_layer_types": ["sparse"]}, "target"),
    ("Qwen3NextForCausalLM", "Qwen3NextConfig", dict(num_experts=8, moe_intermediate_size=16, num_experts_per_tok=2,
                                                     shared_expert_intermediate_size=16, linear_num_key_heads=2,
                                                     linear_num_value_heads=4, linear_key_head_dim=8,
                                                     linear_value_head_dim=8), {"linear_num_value_heads": 3}, "target"),
    ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", dict(num_experts=8, moe_intermediate_size=16,
                                                           shared_expert_intermediate_size=16, linear_num_key_heads=2,
                                                           linear_num_value_heads=4, linear_key_head_dim=8,
                                                           linear_value_head_dim=8),
     {"norm_topk_prob": False}, "target"),
    ("Qwen3_5MoeForConditionalGeneration", None, {}, {"text_config": None}, "target"),
    ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(n_routed_experts=16, moe_intermediate_size=16),
     {"scoring_func": "relu"}, "target"),
    ("DeepseekV2ForCausalLM", "DeepseekV2Config", dict(n_routed_experts=16, moe_intermediate_size=16,
                                                       num_experts_per_tok=2), {"topk_method": "bogus"}, "target"),
    ("DeepseekV32ForCausalLM", "DeepseekV32Config", dict(n_routed_experts=16, moe_intermediate_size=16,
                                                         index_n_heads=2, index_head_dim=64),
     {"index_topk": 0}, "target"),
    ("GlmMoeDsaForCausalLM", "GlmMoeDsaConfig", dict(n_routed_experts=16, moe_intermediate_size=16, index_n_heads=2,
                                                     index_head_dim=64),
     {"indexer_types": ["shared", "full"]}, "target"),
    ("Glm4MoeForCausalLM", "Glm4MoeConfig", dict(n_routed_experts=16, moe_intermediate_size=16),
     {"n_group": 16}, "target"),
    ("Dots1ForCausalLM", "Dots1Config", dict(n_routed_experts=16, n_shared_experts=2, num_experts_per_tok=4,
                                             moe_intermediate_size=16), {"partial_rotary_factor": 0.5}, "target"),
    ("Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeConfig", dict(moe_num_experts=8, moe_k=2, moe_intermediate_size=16),
     {"use_bias": True}, "target"),
    ("DeepseekV3ForCausalLMNextN", "DeepseekV3Config", dict(n_routed_experts=16, moe_intermediate_size=16),
     {"num_nextn_predict_layers": 2}, "speculative"),
    ("Glm4MoeForCausalLMNextN", "Glm4MoeConfig", dict(n_routed_experts=16, moe_intermediate_size=16),
     {"num_nextn_predict_layers": 2}, "speculative"),
    ("KimiK25ForConditionalGeneration", None, {}, {"text_config": None}, "target"),
    ("Qwen3NextForCausalLMMTP", "Qwen3NextConfig", dict(num_experts=8, moe_intermediate_size=16, num_experts_per_tok=2,
                                                        shared_expert_intermediate_size=16, linear_num_key_heads=2,
                                                        linear_num_value_heads=4, linear_key_head_dim=8,
                                                        linear_value_head_dim=8),
     {"num_nextn_predict_layers": 2}, "speculative"),
    ("Qwen3_5ForCausalLMMTP", "Qwen3_5MoeTextConfig", dict(num_experts=8, moe_intermediate_size=16,
                                                           shared_expert_intermediate_size=16, linear_num_key_heads=2,
                                                           linear_num_value_heads=4, linear_key_head_dim=8,
                                                           linear_value_head_dim=8),
     {"mtp_num_hidden_layers": 2}, "speculative"),
]


def test_every_engine_entry_class_reads_its_config_before_the_plan():
    from loadplan.engine.models.causal_lm import CausalLM
    from loadplan.engine.models.nextn import NextNDraft
    from loadplan.engine.registry import ENGINE_ENTRY_CLASSES, model_class

    bases = (CausalLM.parse_config.__func__, NextNDraft.parse_config.__func__)
    assert {arch for arch, *_ in _BAD_CONFIGS} == set(ENGINE_ENTRY_CLASSES)    # a bad config for each
    for arch in ENGINE_ENTRY_CLASSES:
        assert model_class(arch).parse_config.__func__ not in bases, arch


# Entry classes of _BAD_CONFIGS whose config has no rope of the kind the others read: Nemotron-H and Kimi-Linear (no
# layer turns q or k; transformers reads no rope field for them), MiMo-V2-Flash, Step-3.5, Laguna and Mellum (one
# rope_parameters object per layer type, refused by type in their own tests), Mistral 4 (its rope_parameters must
# carry its query scaling; rope_scaling refused: its own test), the wrappers (their text_config's family is here too)
# and the drafts (their target's family is).
_NO_PLAIN_ROPE = {"NemotronHForCausalLM", "KimiLinearForCausalLM", "MiMoV2FlashForCausalLM", "Step3p5ForCausalLM",
                  "Mistral4ForCausalLM", "LagunaForCausalLM", "MellumForCausalLM"}


@pytest.mark.parametrize("arch, hf_class, kwargs", [(a, h, k) for a, h, k, _, role in _BAD_CONFIGS
                                                    if h and role == "target" and a not in _NO_PLAIN_ROPE],
                         ids=lambda v: v if isinstance(v, str) and v.endswith(("LM", "Generation")) else "")
def test_a_rope_the_family_cannot_run_is_refused_naming_the_field_it_is_in(arch, hf_class, kwargs):
    """Whichever spelling the config uses (rope_parameters, transformers 5's; rope_scaling, the Hub's older one)."""
    from loadplan.engine.models.config import ConfigError
    from loadplan.engine.registry import model_class

    transformers = pytest.importorskip("transformers")
    cfg = getattr(transformers, hf_class)(**_TINY, **kwargs).to_dict()
    cfg.pop("rope_scaling", None)
    model_class(arch).parse_config(dict(cfg, architectures=[arch]))     # the config itself is one it runs
    for field in ("rope_parameters", "rope_scaling"):
        bad = {k: v for k, v in cfg.items() if k != "rope_parameters"}
        bad[field] = {"rope_type": "foo", "rope_theta": 10000.0, "factor": 2.0}
        with pytest.raises(ConfigError, match=rf"^config\.{field}: rope type 'foo' not supported; supported: "):
            model_class(arch).parse_config(dict(bad, architectures=[arch]))


def test_a_wrappers_refusal_names_the_field_inside_its_text_config(tmp_path):
    transformers = pytest.importorskip("transformers")
    body = transformers.DeepseekV3Config(**_TINY, n_routed_experts=16, moe_intermediate_size=16).to_dict()
    body["scoring_func"] = "relu"
    cfg = {"architectures": ["KimiK25ForConditionalGeneration"], "text_config": body}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    registry = LocalRegistry()
    with pytest.raises(ValueError, match=r"^config\.text_config\.scoring_func: 'relu' not supported"):
        load_model(tmp_path, registry=registry)
    assert registry.requests == []


@pytest.mark.parametrize("arch, hf_class, kwargs, bad, role", _BAD_CONFIGS, ids=[c[0] for c in _BAD_CONFIGS])
def test_a_config_field_the_family_cannot_run_is_refused_by_name_and_records_no_plan(tmp_path, arch, hf_class,
                                                                                     kwargs, bad, role):
    transformers = pytest.importorskip("transformers")
    (field, value), = bad.items()
    cfg = getattr(transformers, hf_class)(**_TINY, **kwargs).to_dict() if hf_class else {}
    cfg.update(bad, architectures=[arch])
    if value is None:
        del cfg[field]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    registry = LocalRegistry()
    with pytest.raises(ValueError, match=rf"config\.{field}: "):
        load_model(tmp_path, registry=registry, role=role)
    assert registry.requests == []
