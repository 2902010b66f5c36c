from loadplan.integrations.vllm.settings import Settings, settings_from


def test_inert_without_a_registry():
    assert settings_from({}) is None
    assert settings_from({"LOADPLAN_REGISTRY": "  ", "LOADPLAN_DEPLOYMENT": "d"}) is None


def test_registry_and_deployment_from_the_environment():
    assert settings_from({"LOADPLAN_REGISTRY": "registry:50051"}) == Settings("registry:50051", None)
    assert settings_from({"LOADPLAN_REGISTRY": "registry:50051", "LOADPLAN_DEPLOYMENT": " prod-a "}) == \
        Settings("registry:50051", "prod-a")
