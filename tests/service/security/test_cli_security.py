"""The CLI's security options: client flags and environment, `serve`'s tokens and TLS, one-line refusals."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest
from fake_store import FakePlanStore
from sample_requests import deepseek_config

from loadplan.cli.main import main
from loadplan.service.tls import ServerTls

SCRIPT = pathlib.Path(sys.executable).with_name("loadplan")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def model(tmp_path) -> pathlib.Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(deepseek_config()))
    return d


@pytest.fixture
def secured(start_server, pki, token_store):
    """Bearer tokens over mutual TLS; `mtls` are the client flags that pass the handshake."""
    store = FakePlanStore()
    server = start_server(store, tokens=token_store, tls=ServerTls(pki.server_cert, pki.server_key, pki.ca))
    mtls = ("--tls-ca", pki.ca, "--tls-cert", pki.client_cert, "--tls-key", pki.client_key)
    return server, store, ("--registry", f"127.0.0.1:{server.port}", *mtls)


def test_token_flag(capsys, secured, tokens, model):
    server, store, where = secured
    code, out, err = run(capsys, "resolve", "--model", model, *where, "--token", tokens["worker"], "--json")
    assert code == 0, err
    assert json.loads(out)["plan_id"] and store.count() == 1


def test_token_file(capsys, secured, tokens, model, tmp_path):
    server, store, where = secured
    (tmp_path / "token").write_text(tokens["worker"] + "\n")
    code, _, err = run(capsys, "resolve", "--model", model, *where, "--token-file", tmp_path / "token", "--json")
    assert code == 0, err
    assert store.count() == 1


def test_token_from_the_environment(capsys, secured, tokens, model, monkeypatch):
    server, store, where = secured
    monkeypatch.setenv("LOADPLAN_TOKEN", tokens["reader"])
    code, out, err = run(capsys, "plans", "list", *where, "--json")
    assert code == 0, err
    assert json.loads(out) == []


@pytest.mark.parametrize("role, status", [(None, "UNAUTHENTICATED"), ("wrong", "UNAUTHENTICATED"),
                                          ("reader", "PERMISSION_DENIED")])
def test_refusals_are_one_line_without_the_token(capsys, secured, tokens, model, monkeypatch, role, status):
    server, store, where = secured
    monkeypatch.delenv("LOADPLAN_TOKEN", raising=False)
    monkeypatch.delenv("LOADPLAN_TOKEN_FILE", raising=False)
    token = () if role is None else ("--token", "lp-worker-" + "z" * 30 if role == "wrong" else tokens[role])
    code, out, err = run(capsys, "resolve", "--model", model, *where, *token)
    assert code == 2 and out == ""          # bad input: the caller must change its token
    assert err.count("\n") == 1 and err.startswith(f"error: {status}: ")
    for secret in (*tokens.values(), "z" * 30):
        assert secret not in err
    assert store.save_calls == []


def test_plaintext_cli_against_a_tls_registry_fails_in_one_line(capsys, secured, tokens, model):
    server, store, _ = secured
    code, _, err = run(capsys, "backends", "--registry", f"127.0.0.1:{server.port}", "--token", tokens["admin"],
                       "--timeout", "2")
    assert code == 1 and err.count("\n") == 1 and err.startswith("error: UNAVAILABLE: ")
    assert tokens["admin"] not in err


def test_security_flags_need_a_registry(capsys, pki, model, tmp_path):
    code, _, err = run(capsys, "resolve", "--model", model, "--db", f"sqlite:///{tmp_path / 'e.db'}",
                       "--token", "lp-worker-" + "y" * 30, "--tls-ca", pki.ca)
    assert code == 2 and err.startswith("error: INVALID_ARGUMENT: --token, --tls-ca need --registry HOST:PORT")
    assert "y" * 30 not in err


def test_embedded_registry_ignores_security_variables(capsys, pki, model, tmp_path, monkeypatch):
    monkeypatch.setenv("LOADPLAN_TOKEN", "lp-worker-" + "x" * 30)
    monkeypatch.setenv("LOADPLAN_TLS_CA", str(pki.ca))
    code, out, err = run(capsys, "resolve", "--model", model, "--db", f"sqlite:///{tmp_path / 'e.db'}", "--json")
    assert code == 0, err
    assert err == "" and json.loads(out)["plan_id"]


def test_unreadable_token_file_is_bad_input(capsys, secured, model, tmp_path):
    _, _, where = secured
    code, _, err = run(capsys, "resolve", "--model", model, *where, "--token-file", tmp_path / "missing")
    assert code == 2 and err.startswith("error: INVALID_ARGUMENT: --token-file: ") and "cannot read it" in err


@pytest.mark.parametrize("flags, message", [
    (("--tls-client-ca", "CA"), "--tls-client-ca needs --tls-cert and --tls-key"),
    (("--tls-cert", "CERT"), "--tls-cert and --tls-key go together"),
    (("--tls-cert", "CERT", "--tls-key", "NOTPEM"), "TLS key"),
    (("--tokens-file", "BADTOKENS"), "role 'root' not supported; supported: worker, reader, admin"),
])
def test_serve_refuses_bad_security_options_in_one_line(capsys, pki, tmp_path, flags, message):
    (tmp_path / "bad").write_text("root:" + "w" * 30 + "\n")
    (tmp_path / "notpem").write_text("nothing")
    files = {"CA": pki.ca, "CERT": pki.server_cert, "NOTPEM": tmp_path / "notpem", "BADTOKENS": tmp_path / "bad"}
    argv = [files.get(f, f) for f in flags]
    code, out, err = run(capsys, "serve", "--db", f"sqlite:///{tmp_path / 's.db'}", "--listen", "127.0.0.1:0", *argv)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("error: INVALID_ARGUMENT: ") and message in err
    assert "w" * 30 not in err


def test_serve_with_tokens_file_environment_and_mutual_tls(capsys, pki, tokens, model, tmp_path):
    db = f"sqlite:///{tmp_path / 'serve.db'}"
    (tmp_path / "tokens").write_text(f"# workers\nworker:{tokens['worker']}\n")
    env = {**os.environ, "LOADPLAN_TOKENS": f"reader:{tokens['reader']}"}   # adds to the file
    for name in ("LOADPLAN_TOKEN", "LOADPLAN_TOKEN_FILE", "LOADPLAN_TOKENS_FILE"):
        env.pop(name, None)
    exe = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "loadplan.cli.main"]
    proc = subprocess.Popen([*exe, "serve", "--db", db, "--migrate", "--listen", "127.0.0.1:0",
                             "--tokens-file", str(tmp_path / "tokens"), "--tls-cert", str(pki.server_cert),
                             "--tls-key", str(pki.server_key), "--tls-client-ca", str(pki.ca)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "listening on 127.0.0.1:" in line and "mutual TLS" in line and "bearer tokens" in line, \
            line + proc.stderr.read()
        address = line.split("listening on ")[1].split()[0]
        where = ("--registry", address, "--tls-ca", pki.ca, "--tls-cert", pki.client_cert, "--tls-key", pki.client_key)
        code, out, err = run(capsys, "resolve", "--model", model, *where, "--token", tokens["worker"], "--json")
        assert code == 0, err
        code, out, err = run(capsys, "plans", "list", *where, "--token", tokens["reader"], "--json")
        assert code == 0, err
        assert len(json.loads(out)) == 1
        code, _, err = run(capsys, "plans", "list", *where, "--token", tokens["worker"])
        assert code == 2 and err.startswith("error: PERMISSION_DENIED: ")
        code, _, err = run(capsys, "plans", "list", "--registry", address, "--tls-ca", pki.ca,
                           "--token", tokens["reader"], "--timeout", "2")        # no client certificate
        assert code == 1 and err.startswith("error: UNAVAILABLE: ")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        logs = proc.stderr.read()
        assert "authentication on" in logs and "refused" in logs
        assert all(t not in logs for t in tokens.values())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
