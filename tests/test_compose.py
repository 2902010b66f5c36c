"""docker-compose.yml is valid compose-spec and wires what the design says.

No Docker engine runs here: the schema is checked offline (check-jsonschema's
vendored compose-spec) and the wiring is read from the file itself.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_file_matches_the_compose_spec():
    exe = shutil.which("check-jsonschema") or str(pathlib.Path(sys.executable).parent / "check-jsonschema")
    out = subprocess.run([exe, "--builtin-schema", "vendor.compose-spec", str(ROOT / "docker-compose.yml")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_registry_waits_for_migration_and_migration_for_postgres():
    services = _compose()["services"]
    assert services["migrate"]["command"][:2] == ["loadplan", "migrate"]
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["registry"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert services["registry"]["command"][:2] == ["loadplan", "serve"]
    assert "healthcheck" in services["postgres"] and "healthcheck" in services["registry"]


def test_registry_serves_metrics_and_prometheus_scrapes_every_replica():
    registry = _compose()["services"]["registry"]
    command = [str(a) for a in registry["command"]]
    http = command[command.index("--http") + 1]
    port = int(http.rsplit(":", 1)[1])
    assert http.startswith("0.0.0.0:")
    assert any(str(p).endswith(f":{port}") for p in registry["ports"])
    assert registry["labels"]["prometheus.io/port"] == str(port)
    assert registry["labels"]["prometheus.io/path"] == "/metrics"
    scrape = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())["scrape_configs"]
    (job,) = [j for j in scrape if j["metrics_path"] == "/metrics"]
    assert job["dns_sd_configs"] == [{"names": ["registry"], "type": "A", "port": port}]
