"""Report signatures: HMAC-SHA256 from the environment, Ed25519 from PEM files, and clear key errors."""

from __future__ import annotations

import os
import stat

import pytest

from loraledger.audit.signing import (
    ED25519,
    HMAC_SHA256,
    REPORT_KEY_ENV,
    check_signature,
    generate_ed25519_key,
    load_public_key,
    signer_for,
)
from loraledger.errors import ConfigError

KEY = {REPORT_KEY_ENV: "0123456789abcdef-secret"}


def test_hmac_round_trip_and_tamper():
    signer = signer_for(None, unsigned=False, env=KEY)
    assert signer is not None and signer.algorithm == HMAC_SHA256
    sig = signer.sign(b"manifest")
    assert sig.key_id and KEY[REPORT_KEY_ENV] not in (sig.key_id or "")
    assert check_signature(sig, b"manifest", key_file=None, env=KEY) is None
    assert "does not match" in check_signature(sig, b"manifest!", key_file=None, env=KEY)
    assert "does not match" in check_signature(
        sig, b"manifest", key_file=None, env={REPORT_KEY_ENV: "another-key-0123456789"}
    )
    with pytest.raises(ConfigError, match=REPORT_KEY_ENV):
        check_signature(sig, b"manifest", key_file=None, env={})


def test_ed25519_round_trip(tmp_path):
    generate_ed25519_key(tmp_path / "k.pem", tmp_path / "p.pem")
    assert stat.S_IMODE(os.stat(tmp_path / "k.pem").st_mode) == 0o600
    signer = signer_for(tmp_path / "k.pem", unsigned=False, env=KEY)  # an explicit key file wins over the env key
    assert signer is not None and signer.algorithm == ED25519
    sig = signer.sign(b"manifest")
    assert check_signature(sig, b"manifest", key_file=tmp_path / "p.pem") is None
    assert "does not match" in check_signature(sig, b"other", key_file=tmp_path / "p.pem")
    assert load_public_key(tmp_path / "k.pem") is not None
    with pytest.raises(ConfigError, match="never overwritten"):
        generate_ed25519_key(tmp_path / "k.pem")


def test_key_problems_are_named(tmp_path):
    with pytest.raises(ConfigError, match="--unsigned"):
        signer_for(None, unsigned=False, env={})
    assert signer_for(None, unsigned=True, env={}) is None
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        signer_for(None, unsigned=False, env={REPORT_KEY_ENV: "short"})
    with pytest.raises(ConfigError, match="cannot read key file"):
        signer_for(tmp_path / "missing.pem", unsigned=False)
    (tmp_path / "junk.pem").write_text("not a key")
    with pytest.raises(ConfigError, match="not an unencrypted PEM private key"):
        signer_for(tmp_path / "junk.pem", unsigned=False)
    with pytest.raises(ConfigError, match="not a PEM public key"):
        load_public_key(tmp_path / "junk.pem")
