"""`loadplan serve` as a new user runs it: the embedded SQLite default needs no other step;
PostgreSQL still needs `loadplan migrate` and says so; `--http` serves metrics."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.request

import pytest
from cli_helpers import real_model, run
from test_cli_console import SCRIPT, loadplan

from loadplan.service.healthcheck import check


def _serve(*argv: str, cwd=None) -> subprocess.Popen:
    exe = str(SCRIPT) if SCRIPT.exists() else "loadplan"
    return subprocess.Popen([exe, "serve", "--listen", "127.0.0.1:0", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=cwd,
                            env={**os.environ, "LOADPLAN_DB_URL": "", "LOADPLAN_TOKENS": ""})


def _address(proc: subprocess.Popen) -> str:
    line = proc.stdout.readline()
    assert "listening on 127.0.0.1:" in line, line + proc.stderr.read()
    return line.split("listening on ")[1].split()[0]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def test_fresh_sqlite_serve_then_resolve_needs_no_migrate(tmp_path):
    """A fresh clone: `loadplan serve` on its default file (./loadplan.db, created), then a resolve."""
    proc = _serve(cwd=tmp_path)
    try:
        address = _address(proc)
        assert check(address), "a fresh SQLite registry must be SERVING at once"
        done = loadplan("resolve", "--model", real_model("qwen3-30b-a3b"), "--registry", address, "--json")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["decisions"]["model.family"]["value"]
    finally:
        _stop(proc)
    assert proc.returncode == 0
    assert (tmp_path / "loadplan.db").is_file()


def test_unmigrated_postgres_is_not_upgraded_and_says_so(make_postgres_database):
    """Replicas share PostgreSQL: its upgrade stays an operator's step, and serve says which."""
    from loadplan.service.store.db import current_revisions, make_engine

    url = make_postgres_database()
    proc = _serve("--db", url)
    try:
        _address(proc)
        # Printed right after the listening line (read before SIGTERM, which could come first).
        lines = iter(proc.stderr.readline, "")
        warning = next((line for line in lines if line.startswith("warning:")), "")
    finally:
        _stop(proc)
    assert "not migrated" in warning and "loadplan migrate" in warning and "--migrate" in warning, warning
    engine = make_engine(url)
    try:
        assert current_revisions(engine) == frozenset()
    finally:
        engine.dispose()


def test_http_serves_metrics_of_the_resolves(tmp_path):
    proc = _serve("--db", f"sqlite:///{tmp_path / 'm.db'}", "--http", "127.0.0.1:0")
    try:
        address = _address(proc)
        web = proc.stdout.readline()
        assert "web view and /metrics on http://127.0.0.1:" in web, web
        base = web.split(" on ")[1].strip().rstrip("/")
        done = loadplan("resolve", "--model", real_model("deepseek-v3"), "--registry", address, "--ep-size", "2")
        assert done.returncode == 0, done.stderr
        with urllib.request.urlopen(f"{base}/metrics", timeout=5) as r:
            text = r.read().decode()
        assert 'loadplan_resolves_total{engine="loadplan",family="deepseek",role="target",status="OK"} 1.0' in text, text
        assert "loadplan_db_commit_plans_count 1.0" in text
        assert "loadplan_serving 1.0" in text
        with urllib.request.urlopen(f"{base}/deployments", timeout=5) as r:
            assert "DeepseekV3ForCausalLM" in r.read().decode()
    finally:
        _stop(proc)


def test_http_on_a_busy_port_is_one_line(capsys, tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        code, out, err = run(capsys, "serve", "--db", f"sqlite:///{tmp_path / 'b.db'}", "--listen", "127.0.0.1:0",
                             "--http", f"127.0.0.1:{port}")
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"error: FAILED_PRECONDITION: --http: cannot listen on 127.0.0.1:{port}")


@pytest.mark.parametrize("listen", ["nonsense", "127.0.0.1:http"])
def test_http_address_must_be_host_port(capsys, tmp_path, listen):
    code, out, err = run(capsys, "serve", "--db", f"sqlite:///{tmp_path / 'b.db'}", "--listen", "127.0.0.1:0",
                         "--http", listen)
    assert code == 2 and err.startswith(f"error: FAILED_PRECONDITION: --http: {listen!r} is not HOST:PORT"), err


@pytest.mark.parametrize("flag", ["--max-pending-calls", "--workers", "--max-message-bytes"])
@pytest.mark.parametrize("value, problem", [("0", "must be >= 1, got 0"), ("many", "'many' is not an integer")])
def test_a_size_flag_is_refused_naming_it_before_anything_is_created(capsys, tmp_path, flag, value, problem):
    code, out, err = run(capsys, "serve", "--db", f"sqlite:///{tmp_path / 'b.db'}", "--listen", "127.0.0.1:0",
                         flag, value)
    assert code == 2 and out == "" and err == f"error: INVALID_ARGUMENT: {flag}: {problem}\n", err
    assert not (tmp_path / "b.db").exists()
