"""The client's settings: where a token and TLS come from, and in which order."""

from __future__ import annotations

import pytest

from loadplan.client.auth import AuthConfigError, ClientTls, bearer_metadata, resolve_tls, resolve_token

TOKEN = "lp-token-abcdefghijklmnop"


def test_token_precedence(tmp_path):
    path = tmp_path / "token"
    path.write_text(f"  {TOKEN}-file\n")
    env = {"LOADPLAN_TOKEN": f"{TOKEN}-env", "LOADPLAN_TOKEN_FILE": str(path)}
    assert resolve_token(TOKEN, path, env) == TOKEN
    assert resolve_token(None, path, env) == f"{TOKEN}-file"
    assert resolve_token(None, None, env) == f"{TOKEN}-env"
    assert resolve_token(None, None, {"LOADPLAN_TOKEN_FILE": str(path)}) == f"{TOKEN}-file"
    assert resolve_token("", None, env) is None           # explicitly none, whatever the environment says
    assert resolve_token(None, None, {}) is None


@pytest.mark.parametrize("bad", ["two words", "tab\there", "new\nline", "caf\u00e9-token-0000000"])
def test_tokens_must_fit_a_header_and_errors_do_not_echo_them(bad):
    with pytest.raises(AuthConfigError) as info:
        resolve_token(bad, None, {})
    assert bad not in str(info.value) and "printable ASCII" in str(info.value)


def test_bearer_metadata():
    assert bearer_metadata(TOKEN) == (("authorization", f"Bearer {TOKEN}"),)
    assert bearer_metadata(None) == ()


def test_tls_settings():
    env = {"LOADPLAN_TLS_CA": "/etc/ca.pem", "LOADPLAN_TLS_CERT": "/etc/c.pem", "LOADPLAN_TLS_KEY": "/etc/c.key"}
    assert resolve_tls(environ={}) is None                                # plaintext by default
    assert resolve_tls(True, environ={}) == ClientTls()                   # system roots
    assert resolve_tls(environ=env) == ClientTls("/etc/ca.pem", "/etc/c.pem", "/etc/c.key")
    assert resolve_tls(ca="/mine.pem", environ=env).ca == "/mine.pem"    # an argument beats the environment
    assert resolve_tls(False, environ=env) is None                        # plaintext, whatever the environment says
    with pytest.raises(AuthConfigError, match="contradicts"):
        resolve_tls(False, ca="/mine.pem", environ={})
    with pytest.raises(AuthConfigError, match="go together"):
        resolve_tls(key="/k.pem", environ={})
