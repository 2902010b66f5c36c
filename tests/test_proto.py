"""The generated protobuf code in gen/ is what proto/ builds today (never stale, never hand-edited)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_generated_code_is_up_to_date(tmp_path):
    shutil.copytree(ROOT / "proto", tmp_path / "proto")
    shutil.copytree(ROOT / "scripts", tmp_path / "scripts")
    subprocess.run([sys.executable, str(tmp_path / "scripts" / "gen_proto.py")], check=True)
    fresh = tmp_path / "gen" / "loadplan" / "v1"
    current = ROOT / "gen" / "loadplan" / "v1"
    for f in sorted(fresh.iterdir()):
        assert (current / f.name).read_bytes() == f.read_bytes(), f"gen/{f.name} is stale: run `make proto`"


def test_service_name_is_versioned():
    from loadplan.v1 import registry_pb2

    svc = registry_pb2.DESCRIPTOR.services_by_name["ModelRegistry"]
    assert svc.full_name == "loadplan.v1.ModelRegistry"
    assert {"ResolveLoadPlan", "GetPlan", "ListPlans", "DiffPlans", "ListBackends", "CheckCoverage"} <= {
        m.name for m in svc.methods}
