"""The engines table (runtime.engine): defaults by device, versions, and what each profile reads."""

from __future__ import annotations

import pytest

from loadplan.plan import Keys, ResolveRequest, Runtime
from loadplan.errors import InvalidArgument, NotFound
from loadplan.service.rules.devices import parse_device
from loadplan.service.rules.engines import ENGINES, engine_of, with_engine
from loadplan.service.rules.resolve import resolve_decisions

from sample_requests import deepseek_config


def _req(**runtime) -> ResolveRequest:
    return ResolveRequest("r1", "d1", config=deepseek_config(), runtime=Runtime(**runtime))


@pytest.mark.parametrize("device,engine", [("cpu", "loadplan"), ("cuda:9.0", "sglang"), ("hip:9.4", "sglang"),
                                           ("musa:3.1", "sglang")])
def test_default_engine_by_device(device, engine):
    req = _req(device=device)
    assert engine_of(req, parse_device(device)).name == engine


def test_a_decided_request_names_its_engine_and_version():
    req = with_engine(_req(device="cuda:9.0"), ENGINES["sglang"])
    assert (req.runtime.engine, req.runtime.engine_version) == ("sglang", "0.5.23")
    res = resolve_decisions(_req(device="cuda:9.0"))
    assert (res.request.runtime.engine, res.request.runtime.engine_version) == ("sglang", "0.5.23")
    assert res.decisions[Keys.ENGINE_PROFILE].value == "sglang 0.5.23"
    assert res.decisions[Keys.ENGINE_PROFILE].rule == "engine.sglang"


def test_unknown_engine_lists_the_known_ones():
    with pytest.raises(NotFound) as e:
        resolve_decisions(_req(engine="tensorrt"))
    assert e.value.field == "runtime.engine"
    assert all(name in str(e.value) for name in ("loadplan", "sglang", "vllm"))


def test_a_release_without_a_profile_is_refused_naming_the_releases_known():
    with pytest.raises(NotFound) as e:
        resolve_decisions(_req(engine="sglang", engine_version="0.5.19", device="cuda:9.0"))
    assert e.value.field == "runtime.engine_version"
    assert all(v in str(e.value) for v in ("0.5.20", "0.5.21", "0.5.22", "0.5.23"))


@pytest.mark.parametrize("version", ["0.5.20", "0.5.21", "0.5.22", "0.5.23"])
def test_each_profiled_sglang_release_decides_and_the_plan_names_it(version):
    plan = resolve_decisions(_req(engine="sglang", engine_version=version, device="cuda:9.0"))
    assert plan.decisions["engine.profile"].value == f"sglang {version}"
    assert resolve_decisions(_req(engine="sglang", device="cuda:9.0")).decisions["engine.profile"].value == \
        "sglang 0.5.23"     # the newest where the request names none


def test_moe_runner_backend_is_sglangs_alone():
    with pytest.raises(InvalidArgument) as e:
        resolve_decisions(_req(engine="vllm", moe_runner_backend="triton"))
    assert e.value.field == "runtime.moe_runner_backend"
    resolve_decisions(_req(engine="sglang", device="cuda:9.0", moe_runner_backend="triton"))


def test_the_engine_decides_deepseek_on_an_old_gpu():
    """The issue's first finding: on cuda:7.0 the fleet's engine (SGLang) cannot run the fused
    kernel, while loadplan's own torch engine fuses on any device."""
    fused = lambda **rt: resolve_decisions(_req(**rt)).decisions[Keys.SHARED_EXPERTS_FUSION].value  # noqa: E731
    assert fused(device="cuda:7.0") is False
    assert fused(device="cuda:7.0", engine="loadplan") is True
