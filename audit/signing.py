"""Report signatures: HMAC-SHA256 with a shared key from the environment, or Ed25519 with a PEM key file."""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping
from pathlib import Path

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from loraledger.errors import ConfigError

REPORT_KEY_ENV = "LORALEDGER_REPORT_KEY"
HMAC_SHA256 = "hmac-sha256"
ED25519 = "ed25519"
UNSIGNED = "none"
MIN_HMAC_KEY_BYTES = 16


class Signature(msgspec.Struct, frozen=True, kw_only=True):
    algorithm: str  # HMAC_SHA256 | ED25519 | UNSIGNED
    value: str | None = None  # hex
    public_key: str | None = None  # ed25519: raw public key, hex, so a reader can tell which key signed
    key_id: str | None = None  # hmac: a tag that names the key without revealing it


class Signer:
    """Signs message bytes with one key; build it with signer_for()."""

    def __init__(self, algorithm: str, *, hmac_key: bytes | None = None, private_key: Ed25519PrivateKey | None = None):
        self.algorithm = algorithm
        self._hmac_key = hmac_key
        self._private_key = private_key

    def identity(self) -> Signature:
        """The signature's scheme and the key it names (Ed25519: the public key; HMAC: a key id), without a value."""
        if self._private_key is not None:
            public = self._private_key.public_key().public_bytes(
                serialization.Encoding.Raw, serialization.PublicFormat.Raw
            )
            return Signature(algorithm=ED25519, public_key=public.hex())
        assert self._hmac_key is not None
        return Signature(algorithm=HMAC_SHA256, key_id=hmac_key_id(self._hmac_key))

    def sign(self, message: bytes) -> Signature:
        if self._private_key is not None:
            value = self._private_key.sign(message).hex()
        else:
            assert self._hmac_key is not None
            value = hmac.new(self._hmac_key, message, hashlib.sha256).hexdigest()
        return msgspec.structs.replace(self.identity(), value=value)


def hmac_key_id(key: bytes) -> str:
    return hmac.new(key, b"loraledger report key id", hashlib.sha256).hexdigest()[:16]


def signer_for(key_file: Path | str | None, *, unsigned: bool, env: Mapping[str, str] = os.environ) -> Signer | None:
    """The signer a report is written with: the Ed25519 key file if given, else the HMAC key in the environment.

    None only when unsigned=True and neither is available; a report is never left unsigned silently.
    """
    if key_file is not None:
        return Signer(ED25519, private_key=load_private_key(key_file))
    key = _hmac_key_from_env(env)
    if key is not None:
        return Signer(HMAC_SHA256, hmac_key=key)
    if unsigned:
        return None
    raise ConfigError(
        f"no signing key: set ${REPORT_KEY_ENV} (HMAC-SHA256, at least {MIN_HMAC_KEY_BYTES} bytes) "
        "or pass --key-file ed25519.pem; pass --unsigned to write an unsigned report on purpose"
    )


def _hmac_key_from_env(env: Mapping[str, str]) -> bytes | None:
    text = env.get(REPORT_KEY_ENV)
    if not text:
        return None
    key = text.encode()
    if len(key) < MIN_HMAC_KEY_BYTES:
        raise ConfigError(
            f"${REPORT_KEY_ENV} is {len(key)} bytes long; use a random key of at least {MIN_HMAC_KEY_BYTES} bytes"
        )
    return key


def load_private_key(path: Path | str) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(_read_pem(path), password=None)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{path} is not an unencrypted PEM private key: {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"{path} holds a {type(key).__name__}, not an Ed25519 private key")
    return key


def load_public_key(path: Path | str) -> Ed25519PublicKey:
    """An Ed25519 public key from a PEM file; a private key file works too (its public half is used)."""
    data = _read_pem(path)
    if b"PRIVATE KEY" in data:
        return load_private_key(path).public_key()
    try:
        key = serialization.load_pem_public_key(data)
    except ValueError as exc:
        raise ConfigError(f"{path} is not a PEM public key: {exc}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise ConfigError(f"{path} holds a {type(key).__name__}, not an Ed25519 public key")
    return key


def _read_pem(path: Path | str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read key file {path}: {exc.strerror}") from None


def check_signature(
    signature: Signature, message: bytes, *, key_file: Path | str | None, env: Mapping[str, str] = os.environ
) -> str | None:
    """None when the signature is valid for the message, else what is wrong."""
    if signature.algorithm == UNSIGNED:
        return "the report is unsigned"
    if signature.value is None:
        return f"the {signature.algorithm} signature has no value"
    if key_file is not None and signature.algorithm != ED25519:
        # the verifier asked for the signer's public key to be the proof: a shared-key signature is not that proof
        # (whoever holds the shared key could have edited and re-signed the report)
        return (
            f"the report is signed with {signature.algorithm}, not with the Ed25519 key given (--key-file): "
            "it was not signed by that key's holder"
        )
    if signature.algorithm == HMAC_SHA256:
        key = _hmac_key_from_env(env)
        if key is None:
            raise ConfigError(
                f"the report is signed with HMAC-SHA256: set ${REPORT_KEY_ENV} to the key it was signed with"
            )
        expected = hmac.new(key, message, hashlib.sha256).hexdigest()
        if not hmac.compare_digest(expected, signature.value):
            return "the HMAC-SHA256 signature does not match the manifest (edited, or signed with another key)"
        return None
    if signature.algorithm == ED25519:
        if key_file is None:
            raise ConfigError("the report is signed with Ed25519: pass --key-file with the signer's public key (PEM)")
        try:
            load_public_key(key_file).verify(bytes.fromhex(signature.value), message)
        except (InvalidSignature, ValueError):
            return "the Ed25519 signature does not match the manifest (edited, or signed with another key)"
        return None
    return f"unknown signature algorithm {signature.algorithm!r}"


def generate_ed25519_key(private_path: Path | str, public_path: Path | str | None = None) -> None:
    """Write a fresh Ed25519 key pair as PEM files (private: PKCS8, unencrypted, mode 0600, never overwritten)."""
    key = Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    try:
        fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ConfigError(f"{private_path} already exists: a key file is never overwritten") from None
    with os.fdopen(fd, "wb") as out:
        out.write(private_pem)
    if public_path is not None:
        Path(public_path).write_bytes(
            key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        )
