"""The token store: file and environment formats, digests only, constant-time lookup, errors that hide tokens."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from loadplan.service import auth
from loadplan.service.auth import TokenConfigError, load_tokens, parse_entries

WORKER = "worker-token-0123456789abcdef"
READER = "reader-token-0123456789abcdef"
ADMIN = "admin-token-0123456789abcdefgh"


def test_file_lines_comments_and_sha256_entries(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(f"# role:token\n\nworker:{WORKER}\n  reader:{READER}  \n"
                    f"admin:sha256:{hashlib.sha256(ADMIN.encode()).hexdigest()}\n")
    store = load_tokens(path, environ={})
    assert len(store) == 3
    assert (store.role_of(WORKER), store.role_of(READER), store.role_of(ADMIN)) == ("worker", "reader", "admin")
    assert store.role_of("not-a-configured-token-at-all") is None
    assert store.role_of(WORKER[:-1]) is None and store.role_of(WORKER + "x") is None
    assert store.role_of("sha256:" + hashlib.sha256(ADMIN.encode()).hexdigest()) is None   # the digest is no token


def test_environment_entries_add_to_the_file(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(f"worker:{WORKER}\n")
    env = {"LOADPLAN_TOKENS_FILE": str(path), "LOADPLAN_TOKENS": f"reader:{READER}, admin:{ADMIN}"}
    store = load_tokens(environ=env)
    assert [store.role_of(t) for t in (WORKER, READER, ADMIN)] == ["worker", "reader", "admin"]
    assert load_tokens(environ={"LOADPLAN_TOKENS": f"admin:{ADMIN} worker:{WORKER}"}).role_of(WORKER) == "worker"


def test_no_tokens_means_open_but_an_empty_file_is_an_error(tmp_path):
    assert load_tokens(environ={}) is None
    empty = tmp_path / "tokens"
    empty.write_text("# nobody yet\n")
    with pytest.raises(TokenConfigError, match="holds no tokens"):
        load_tokens(empty, environ={})


def test_only_digests_are_kept():
    store = parse_entries([("t", f"worker:{WORKER}")])
    assert [(e.digest, e.role) for e in store._entries] == [(hashlib.sha256(WORKER.encode()).digest(), "worker")]
    assert WORKER not in repr(vars(store))
    assert WORKER not in repr(store) and "1 worker" in repr(store)


@pytest.mark.parametrize("line, message", [
    (f"operator:{WORKER}", "role 'operator' not supported; supported: worker, reader, admin"),
    (WORKER, "expected ROLE:TOKEN"),
    ("worker:", "expected ROLE:TOKEN"),
    ("worker:short-token", "shorter than 16 characters"),
    (f"worker:{WORKER}\u00e9", "printable ASCII"),
])
def test_bad_entries_name_the_line_not_the_token(tmp_path, line, message):
    path = tmp_path / "tokens"
    path.write_text(f"reader:{READER}\n{line}\n", encoding="utf-8")
    with pytest.raises(TokenConfigError) as info:
        load_tokens(path, environ={})
    text = str(info.value)
    assert message in text and "line 2" in text
    assert WORKER not in text and "short-token" not in text and READER not in text


def test_a_token_has_one_role():
    with pytest.raises(TokenConfigError, match="the same token as a; each token has one role") as info:
        parse_entries([("a", f"worker:{WORKER}"), ("b", f"admin:{WORKER}")])
    assert WORKER not in str(info.value)


def test_unreadable_file_is_a_config_error(tmp_path):
    with pytest.raises(TokenConfigError, match="cannot read it"):
        load_tokens(tmp_path / "missing", environ={})


@pytest.mark.parametrize("presented", [WORKER, READER, ADMIN, "an-unknown-token-of-some-length", "x"])
def test_every_digest_is_compared_whatever_matches(monkeypatch, presented):
    store = parse_entries([("a", f"worker:{WORKER}"), ("b", f"reader:{READER}"), ("c", f"admin:{ADMIN}")])
    calls, real = [], hmac.compare_digest

    def counting(a, b):
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    store.role_of(presented)
    # No early exit, and always fixed-size digests: neither which entry matched nor the length leaks.
    assert calls == [(32, 32)] * 3


def test_the_role_table_covers_every_rpc_and_fails_closed():
    assert auth.check_table() == []
    assert auth.allowed_roles("SomeFutureRpc") == frozenset({"admin"})
