"""docker-compose.yml, run as local processes on loopback (compose_local.py), on the machine's PostgreSQL.

The file is the source of truth: commands, environment, replicas, health checks and
the start order all come from it, so a change there that breaks the wiring breaks
this test. The `postgres` container is replaced by a fresh database on the test
server (LOADPLAN_TEST_POSTGRES_URL), passed in as compose would get it: through the
POSTGRES_* variables.
"""

from __future__ import annotations

import json
import re

import pytest
from sqlalchemy.engine import make_url

from compose_local import ROOT, LocalCompose, depends_on, dockerfile_of, load

pytestmark = [pytest.mark.heavy(21), pytest.mark.timeout(180)]

# What each image leaves out (its Dockerfile installs `.[service]` resp. `.[engine]`):
# the services built from it run here without those modules.
ABSENT = {"Dockerfile.registry": ("torch", "transformers", "safetensors"),
          "Dockerfile.worker": ("sqlalchemy", "alembic", "psycopg")}


@pytest.fixture(scope="module")
def compose(make_postgres_database, tmp_path_factory):
    url = make_url(make_postgres_database())
    variables = {"POSTGRES_USER": url.username or "", "POSTGRES_PASSWORD": url.password or "",
                 "POSTGRES_DB": url.database}
    stack = LocalCompose(tmp_path_factory.mktemp("compose"), variables,
                         external={"postgres": (url.host or "127.0.0.1", url.port or 5432)}, absent=ABSENT)
    stack.database_url = url.render_as_string(hide_password=False)
    try:
        yield stack
    finally:
        stack.down()
    left = [f"{rep.service}[{rep.index}] pid {rep.proc.pid}" for rep in stack.started if rep.proc.poll() is None]
    assert not left, f"processes left running after down: {left}"


def _arg(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_the_file_wires_what_the_test_runs():
    """The facts the rest of this module relies on, read from the file (so a drift fails here first)."""
    services = load({})["services"]
    assert depends_on(services["migrate"]) == {"postgres": "service_healthy"}
    assert depends_on(services["registry"]) == {"migrate": "service_completed_successfully"}
    assert depends_on(services["worker"]) == {"registry": "service_healthy",
                                              "checkpoints": "service_completed_successfully"}
    assert services["registry"]["deploy"]["replicas"] == 2
    worker = [str(a) for a in services["worker"]["command"]]
    assert worker[:2] == ["loadplan", "generate"]
    assert _arg(worker, "--nproc") == "2" and _arg(worker, "--ep-size") == "2"
    assert _arg(worker, "--registry") == "registry:50051"
    assert "--draft" in worker
    # Defaults point at the compose network's service names, never at a local file.
    assert "@postgres:5432/" in services["registry"]["environment"]["LOADPLAN_DB_URL"]


def test_the_images_install_what_absent_says():
    registry = (ROOT / "Dockerfile.registry").read_text()
    worker = (ROOT / "Dockerfile.worker").read_text()
    assert "'.[service]'" in registry and "torch" not in registry.split("pip install")[-1].split("&&")[0]
    assert "'.[engine]'" in worker and "service" not in re.findall(r"'\.\[([a-z,]+)\]'", worker)[0]
    services = load({})["services"]
    for name in ("migrate", "registry"):
        assert dockerfile_of(services, name) == "Dockerfile.registry"
    for name in ("checkpoints", "worker"):
        assert dockerfile_of(services, name) == "Dockerfile.worker"


def test_migrate_then_two_registry_replicas_pass_their_health_check(compose):
    compose.up(until="registry")
    compose.wait_healthy("registry")
    replicas = compose.replicas["registry"]
    assert len(replicas) == compose.replica_count("registry") == 2
    assert len({r.ports[50051] for r in replicas}) == 2
    for rep in replicas:
        res = compose.healthcheck(rep)
        assert res.returncode == 0, res.stdout + res.stderr
        assert res.stdout.strip() == "SERVING"
    assert "is at head" in compose.replicas["migrate"][0].output()


def test_up_again_leaves_the_running_replicas_alone(compose):
    """As `docker compose up`: bringing up a service whose dependencies run already starts only
    what is not running (no second registry per port, no replica lost to `down`)."""
    compose.up(until="registry")
    compose.wait_completed("migrate")
    before = [rep.proc.pid for rep in compose.replicas["registry"]]
    assert compose.up(until="registry") == ["migrate"]          # the finished job runs again, as compose does
    compose.wait_completed("migrate")
    assert [rep.proc.pid for rep in compose.replicas["registry"]] == before
    assert compose.running("registry")


def test_checkpoint_job_writes_target_and_draft(compose):
    compose.up(until="checkpoints")
    compose.wait_completed("checkpoints")
    root = compose.volume_dir("checkpoints")
    target = json.loads((root / "target" / "config.json").read_text())
    draft = json.loads((root / "draft" / "config.json").read_text())
    assert target["architectures"] == ["DeepseekV3ForCausalLM"] and target["n_routed_experts"] == 256
    assert draft["architectures"][0] != target["architectures"][0]
    assert draft["vocab_size"] == target["vocab_size"]


def test_worker_pair_resolves_its_plans_through_the_registry(compose):
    from loadplan.client import RegistryClient
    from loadplan.service.store.db import make_engine

    try:
        import loadplan.cli.generate  # noqa: F401
    except ImportError as e:
        pytest.fail(f"the worker service runs `loadplan generate`, whose module loadplan.cli.generate cannot be "
                    f"imported yet ({e}): the engine issue's CLI must exist for the compose worker", pytrace=False)
    compose.up(until="worker")
    compose.wait_completed("worker", timeout=150)
    worker = compose.replicas["worker"][0]
    out = json.loads(worker.output().strip().splitlines()[-1])
    max_new = int(_arg(worker.argv, "--max-new-tokens"))
    assert 0 < len(out["tokens"]) <= max_new
    assert 0.0 <= out["acceptance_rate"] <= 1.0

    deployment = _arg(worker.argv, "--deployment")
    engine = make_engine(compose.database_url)
    try:
        with engine.connect() as conn:
            rows = conn.exec_driver_sql(
                "SELECT role, ep_rank, ep_size, entry_class FROM plans WHERE deployment_id = %(d)s",
                {"d": deployment}).all()
    finally:
        engine.dispose()
    by_role = {}
    for role, ep_rank, ep_size, entry in rows:
        assert ep_size == 2
        by_role.setdefault(role, []).append((ep_rank, entry))
    assert sorted(by_role) == ["speculative", "target"]
    assert sorted(r for r, _ in by_role["target"]) == [0, 1]
    assert sorted(r for r, _ in by_role["speculative"]) == [0, 1]
    assert {e for _, e in by_role["target"]} == {"DeepseekV3ForCausalLM"}

    # Both replicas serve the same history: they share nothing but the database.
    seen = []
    for rep in compose.replicas["registry"]:
        with RegistryClient(f"127.0.0.1:{rep.ports[50051]}") as client:
            seen.append(sorted(p.plan_id for p in client.iter_plans(deployment_id=deployment)))
    assert len(seen[0]) == 4 and seen[0] == seen[1]
