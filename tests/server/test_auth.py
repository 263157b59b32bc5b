"""Keys: the file's format and checks, constant-time lookup, rate limits, reloads; binding without keys; the CLI."""

from __future__ import annotations

import hashlib

import pytest
import tomllib

from loraledger.cli import main
from loraledger.errors import ConfigError
from loraledger.server.auth import Caller, KeyRing, RateLimit, RateLimiter, add_key, read_keys_file
from loraledger.server.server_config import check_bind, is_loopback


def test_add_key_stores_only_the_hash_and_the_ring_finds_it(tmp_path):
    path = tmp_path / "keys.toml"
    key_id, key = add_key(path, tenant="acme", adapters=["sql", "support-*"], rate_limit="10/second")
    text = path.read_text()
    assert key not in text and hashlib.sha256(key.encode()).hexdigest() in text
    assert path.stat().st_mode & 0o777 == 0o600
    [entry] = read_keys_file(path)
    assert (entry.key_id, entry.tenant, entry.adapters, entry.role, str(entry.rate_limit)) == (
        key_id,
        "acme",
        ("sql", "support-*"),
        "user",
        "10/second",
    )
    ring = KeyRing(path)
    assert ring.authenticate(key) == entry and ring.authenticate(key + "x") is None and ring.authenticate("") is None


def test_globs_name_what_a_key_may_use():
    caller = Caller(tenant="t", key_id="k", role="user", adapters=("base", "support-*"))
    assert caller.may_use("base") and caller.may_use("support-de") and not caller.may_use("sql") and not caller.is_admin


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ('id = "k1"\nsha256 = "abc"\ntenant = "t"\nadapters = ["*"]', "sha256"),
        (f'id = "k1"\nsha256 = "{"a" * 64}"\ntenant = ""\nadapters = ["*"]', "tenant"),
        (f'id = "k1"\nsha256 = "{"a" * 64}"\ntenant = "t"\nadapters = []', "adapters"),
        (f'id = "k1"\nsha256 = "{"a" * 64}"\ntenant = "t"\nadapters = ["*"]\nrole = "root"', "role"),
        (f'id = "k1"\nsha256 = "{"a" * 64}"\ntenant = "t"\nadapters = ["*"]\nrate_limit = "fast"', "rate limit"),
        (f'id = "k1"\nsha256 = "{"a" * 64}"\ntenant = "t"\nadapters = ["*"]\nplaintext = "x"', "unknown fields"),
    ],
)
def test_a_bad_keys_file_is_refused_naming_the_problem(tmp_path, entry, match):
    path = tmp_path / "keys.toml"
    path.write_text("[[keys]]\n" + entry + "\n")
    with pytest.raises(ConfigError, match=match):
        read_keys_file(path)


def test_reload_swaps_in_a_good_file_and_keeps_the_old_keys_for_a_bad_one(tmp_path):
    path = tmp_path / "keys.toml"
    _, first = add_key(path, tenant="a", adapters=["*"])
    ring = KeyRing(path)
    _, second = add_key(path, tenant="b", adapters=["*"])
    assert ring.authenticate(second) is None
    assert ring.reload() and ring.authenticate(second).tenant == "b"
    path.write_text(path.read_text() + "\n[[keys]]\nid = 3\n")
    assert not ring.reload()
    assert ring.authenticate(first).tenant == "a" and ring.authenticate(second).tenant == "b"


def test_the_rate_limiter_is_a_token_bucket_per_key():
    limiter, limit = RateLimiter(), RateLimit.parse("2/hour")
    assert limiter.take("k", limit) == 0 and limiter.take("k", limit) == 0
    wait = limiter.take("k", limit)
    assert 1700 < wait <= 1800 and limiter.take("other", limit) == 0


def test_without_keys_only_loopback_unless_insecure():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and not is_loopback("0.0.0.0")
    check_bind("127.0.0.1", has_keys=False, insecure_no_auth=False)
    check_bind("0.0.0.0", has_keys=True, insecure_no_auth=False)
    check_bind("0.0.0.0", has_keys=False, insecure_no_auth=True)
    with pytest.raises(ConfigError, match="without API keys.*--insecure-no-auth"):
        check_bind("0.0.0.0", has_keys=False, insecure_no_auth=False)


def test_keys_add_prints_the_key_once_and_serve_refuses_an_open_address(tmp_path, capsys, tiny_llama):
    path = tmp_path / "keys.toml"
    assert main(["keys", "add", "--file", str(path), "--tenant", "acme", "--adapters", "sql, support", "--admin"]) == 0
    out, err = capsys.readouterr()
    key = out.strip()
    [entry] = tomllib.loads(path.read_text())["keys"]
    assert entry["sha256"] == hashlib.sha256(key.encode()).hexdigest() and entry["role"] == "admin"
    assert entry["adapters"] == ["sql", "support"] and key not in err and entry["id"] in err
    assert main(["keys", "list", "--file", str(path)]) == 0
    assert key not in capsys.readouterr().out
    code = main(
        ["serve", str(tiny_llama.model_dir), "--host", "0.0.0.0", "--audit-url", f"sqlite:///{tmp_path / 'a.db'}"]
    )
    assert code == 2 and "--insecure-no-auth" in capsys.readouterr().err
