"""DIGESTS.md is enough to write a verifier: an implementation made from it alone (spec_verifier.py, which imports
nothing of loraledger) reproduces every test vector, and so does loraledger.digests itself."""

from __future__ import annotations

import ast
import datetime as dt
import types
from pathlib import Path

import msgspec
import pytest

from loraledger import digests
from loraledger.store.records import CompletionRecord, RequestRecord
from tests.digests import spec_verifier as spec
from tests.digests.spec_vectors import vectors

V = vectors()


def test_the_spec_verifier_imports_nothing_of_loraledger():
    tree = ast.parse(Path(spec.__file__).read_text())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert imported and not [m for m in imported if m.startswith(("loraledger", "tests"))], imported


@pytest.mark.parametrize("impl", ["spec", "engine"])
def test_canonical_json(impl):
    v = V["canonical_json"]
    cj = spec.cj if impl == "spec" else digests.canonical_json
    assert cj(v["value"]).decode() == v["cj"]
    assert (spec.digest if impl == "spec" else digests.digest)(v["value"]) == v["sha256"]


@pytest.mark.parametrize("impl", ["spec", "engine"])
def test_floats(impl):
    v = V["floats"]
    cj = spec.cj if impl == "spec" else digests.canonical_json
    assert [cj(x).decode() for x in v["values"]] == v["cj"]
    assert all(isinstance(x, float) for x in v["values"])


def test_stored_time():
    for case in V["stored_time"]["cases"]:
        assert spec.stored_microseconds(case["t"]) == case["us"]
        assert spec.stored_time(case["t"]) == digests.stored_time(case["t"]) == case["read_back"]
        stored = digests.stored_datetime(case["t"])
        assert (stored - dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)) // dt.timedelta(microseconds=1) == case["us"]


def test_event_chain():
    prev = digests.GENESIS_HASH
    for event in V["event_chain"]["events"]:
        assert event["prev_hash"] == prev
        fields = [event[k] for k in ("seq", "at", "kind", "request_id", "payload", "dedup_key")]
        fields += [event["instance_id"]] if event["instance_id"] is not None else []
        assert spec.cj(fields).decode() == event["cj"]
        at = dt.datetime.fromisoformat(event["at"].replace("Z", "+00:00"))
        engine_fields = digests.EventFields(
            event["seq"],
            at,
            event["kind"],
            event["request_id"],
            event["payload"],
            event["dedup_key"],
            event["instance_id"],
        )
        assert digests.canonical_json(digests.hashed_fields(engine_fields)).decode() == event["cj"]
        assert spec.event_hash(prev, event) == digests.event_hash(prev, engine_fields) == event["hash"]
        prev = event["hash"]


def test_binding_sha256():
    v = V["binding_sha256"]
    record = msgspec.convert(v["binding"], RequestRecord)
    assert spec.digest(v["binding"]) == digests.binding_digest(v["binding"]) == v["sha256"]
    # a binding from revisions 0013-0015 carries the salted-text keys: digested as the payload carries it
    assert spec.digest(v["salted_binding"]) == digests.binding_digest(v["salted_binding"]) == v["salted_sha256"]
    # a binding written today carries every key of the record (null where unused), its caller content committed
    content = msgspec.convert(v["content_binding"], RequestRecord)
    assert set(msgspec.to_builtins(content)) == set(v["content_binding"]), "the vector misses a key of a binding"
    assert spec.digest(v["content_binding"]) == digests.binding_digest(content) == v["content_sha256"]
    unset = {name: None for name in RequestRecord.__struct_fields__}
    assert digests.binding_digest(record) == digests.binding_digest({**unset, **v["binding"]})


def test_completions_sha256():
    v = V["completions_sha256"]
    records = [msgspec.convert(c, CompletionRecord) for c in v["completions"]]
    assert spec.completions_sha256(v["completions"]) == digests.completions_digest(records) == v["sha256"]
    streamed = digests.CompletionsDigest()
    for record in sorted(records, key=lambda r: r.index):
        streamed.add(record)
    assert streamed.hexdigest() == v["sha256"]
    salted = [msgspec.convert(c, CompletionRecord) for c in v["salted_completions"]]
    assert spec.completions_sha256(v["salted_completions"]) == digests.completions_digest(salted) == v["salted_sha256"]
    content = [msgspec.convert(c, CompletionRecord) for c in v["content_completions"]]  # form v3
    assert spec.completions_sha256(v["content_completions"]) == digests.completions_digest(content)
    assert digests.completions_digest(content) == v["content_sha256"]


def test_text_commitment():
    v = V["text_commitment"]
    for part in (v["prompt"], v["completion"]):
        salt = part["salt"]
        assert spec.text_commitment(salt, part["text"]) == digests.text_commitment(salt, part["text"])
        assert digests.text_commitment(salt, part["text"]) == part["text_commitment"]
        ids = part["token_ids"]
        assert (
            spec.token_ids_commitment(salt, ids)
            == digests.token_ids_commitment(salt, ids)
            == part["token_ids_commitment"]
        )
    for part in v["content"]:  # tools, constraint, tool calls (revision 0016 on): text only
        assert spec.text_commitment(part["salt"], part["text"]) == digests.text_commitment(part["salt"], part["text"])
        assert digests.text_commitment(part["salt"], part["text"]) == part["text_commitment"]
    assert spec.digest(sorted(v["erased"])) == digests.erased_requests_digest(v["erased"]) == v["requests_sha256"]
    with pytest.raises(ValueError, match="16 bytes"):
        digests.text_commitment("00ff", "x")


def test_prompt_sha256():
    v = V["prompt_sha256"]
    assert spec.sha256(v["text"].encode("utf-8")) == digests.prompt_digest(v["text"], [0]) == v["text_sha256"]
    ids_text = spec.cj_text(v["token_ids"]).encode("ascii")
    assert spec.sha256(ids_text) == digests.prompt_digest(None, v["token_ids"]) == v["token_ids_sha256"]


def test_registration_sha256():
    v = V["registration_sha256"]
    assert spec.digest(v["adapter"]) == digests.registration_digest(v["adapter"]) == v["sha256"]


def test_adapter_fingerprint():
    v = V["adapter_fingerprint"]
    tensors = [(t["name"], t["dtype"], t["shape"], bytes.fromhex(t["hex"])) for t in v["tensors"]]
    engine_tensors = [types.SimpleNamespace(name=n, dtype=d, shape=tuple(s), data=b) for n, d, s, b in tensors]
    assert spec.adapter_fingerprint(v["config"], tensors) == digests.adapter_fingerprint(v["config"], engine_tensors)
    assert digests.adapter_fingerprint(v["config"], engine_tensors) == v["fingerprint"]


def test_base_model_fingerprint(tmp_path):
    v = V["base_model_fingerprint"]
    files = [(f["name"], bytes.fromhex(f["hex"])) for f in v["files"]]
    for name, data in files:
        (tmp_path / name).write_bytes(data)
    engine = digests.base_model_fingerprint(v["config"], [tmp_path / name for name, _ in files])
    assert spec.base_model_fingerprint(v["config"], files) == engine == v["fingerprint"]


def test_report(tmp_path):
    v = V["report"]
    assert spec.report_signed_message(v["manifest"]).decode() == v["signed_message"]
    assert digests.report_signed_message(v["manifest"]).decode() == v["signed_message"]
    (tmp_path / "f").write_bytes(bytes.fromhex(v["file_hex"]))
    assert spec.sha256(bytes.fromhex(v["file_hex"])) == digests.file_sha256(tmp_path / "f") == v["file_sha256"]
