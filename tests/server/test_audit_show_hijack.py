"""`audit show` cannot be pointed at the wrong request by a caller's chosen X-Request-Id: an exact audit key always
wins, and a text that is both a caller id and a key prefix lists every candidate instead of choosing."""

from __future__ import annotations

import httpx

from loraledger.cli import main
from tests.server.conftest import BASE


def _complete(live, key: str, caller_id: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {key}"}
    if caller_id is not None:
        headers["X-Request-Id"] = caller_id
    r = httpx.post(f"{live.base_url}/v1/completions", headers=headers, timeout=60,
                   json={"model": BASE, "prompt": "hello", "max_tokens": 2})  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()["id"]


def test_a_caller_id_equal_to_another_tenants_key_or_its_prefix_does_not_hijack_audit_show(live, keys, capsys):
    victim = _complete(live, keys.admin)
    attacker_full = _complete(live, keys.acme, caller_id=victim)
    prefix = victim[:13]
    attacker_prefix = _complete(live, keys.acme, caller_id=prefix)

    assert main(["audit", "show", victim, "--url", live.audit_url]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"request {victim} ") and "tenant        ops" in out
    assert attacker_full not in out and "acme" not in out

    assert main(["audit", "show", prefix, "--url", live.audit_url]) == 2
    err = capsys.readouterr().err
    assert "caller request id" in err and "audit key prefix" in err
    assert attacker_prefix in err and victim in err

    # asked for explicitly, the caller's id finds the attacker's request, and says how it matched
    assert main(["audit", "show", prefix, "--caller-id", "--url", live.audit_url]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"caller request id {prefix} was used by 1 request (matched as the caller's id")
    assert f"request {attacker_prefix} " in out and "tenant        acme" in out


def test_audit_listings_escape_control_characters_of_names(live, keys, capsys):
    evil = "red\x1b[31m\x9b2J\u2028x"
    r = httpx.post(f"{live.base_url}/v1/load_lora_adapter", headers={"Authorization": f"Bearer {keys.admin}"},
                   json={"lora_name": evil, "lora_path": str(live.tiny.adapters["ogd_r16_rslora"])}, timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text
    rid = _complete_model(live, keys.admin, evil)
    for argv in (["audit", "requests"], ["audit", "adapters"], ["audit", "show", rid]):
        capsys.readouterr()  # the in-process server's own log lines are not the command's output
        assert main([*argv, "--url", live.audit_url]) == 0
        out = capsys.readouterr().out
        assert "\x1b" not in out and "\x9b" not in out and "\u2028" not in out, argv
    assert "red\\x1b[31m\\x9b2J\\u2028x" in out


def _complete_model(live, key: str, model: str) -> str:
    r = httpx.post(f"{live.base_url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                   json={"model": model, "prompt": "hello", "max_tokens": 2})  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()["id"]
