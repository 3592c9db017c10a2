"""Who made a checkpoint archive: Ed25519 signatures with the operator's key.

ARCHIVE.sha256 travels with the archive, so it proves the copy is intact,
not where it came from: whoever can replace the archive can replace its
sidecar. A signature can only be made with the private key the operator
keeps on the nodes that checkpoint; the restoring node holds the public key.

    cudahook migrate keygen --out KEY          KEY (0600) and KEY.pub
    cudahook migrate checkpoint ... --sign-key KEY          also ARCHIVE.sig
    cudahook migrate restore ARCHIVE --verify-key KEY.pub   (or a trusted-keys
        directory, `migrate_trusted_keys_dir`; `migrate_require_signature`)

ARCHIVE.sig is JSON: `statement`, the exact text signed (itself JSON: the
archive's sha256 and size, when it was signed, the container's name), the
base64 `signature` and the signing key's `key_id` (its fingerprint).
Signature and key files come from outside: read as safeio reads them.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from cudahook.platform.errors import UsageError, one_line

SIG = ".sig"
FORMAT = "cudahook-migrate-signature/1"
MAX_KEY_BYTES = 16 << 10
MAX_SIG_BYTES = 64 << 10
MAX_TRUSTED = 256


class SignatureRefused(UsageError):
    """The archive's signature is missing, malformed or made by no trusted
    key: untrusted input, nothing was changed. One escaped line."""

    def __init__(self, message: str) -> None:
        super().__init__(one_line(message))


def _crypto() -> Any:
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError as exc:
        from cudahook.platform.errors import EnvironmentProblem

        raise EnvironmentProblem("signing needs the Python package 'cryptography' "
                                 "(pip install cryptography)") from exc
    return serialization, ed25519


def signature_path(archive: Path) -> Path:
    return archive.with_name(archive.name + SIG)


def key_id(public_raw: bytes) -> str:
    return "ed25519:" + hashlib.sha256(public_raw).hexdigest()[:32]


def _public_raw(public: Any) -> bytes:
    serialization, _ = _crypto()
    return bytes(public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw))


def _write_new(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)  # whatever the umask
        os.write(fd, data)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)


def keygen(out: Path) -> dict[str, str]:
    """A new key pair: OUT (private, 0600) and OUT.pub (public, 0644); never
    over an existing file."""
    serialization, ed25519 = _crypto()
    pub = out.with_name(out.name + ".pub")
    for p in (out, pub):
        if os.path.lexists(p):
            raise UsageError(f"{p} exists already: not overwritten")
    key = ed25519.Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.PEM,
                                           serialization.PublicFormat.SubjectPublicKeyInfo)
    try:
        _write_new(out, private, 0o600)
        _write_new(pub, public, 0o644)
    except FileExistsError:
        out.unlink(missing_ok=True)
        raise UsageError(f"{out} or {pub} appeared meanwhile: not overwritten") from None
    except OSError as exc:
        raise UsageError(f"cannot write {exc.filename}: {exc.strerror}") from exc
    return {"private_key": str(out), "public_key": str(pub),
            "key_id": key_id(_public_raw(key.public_key()))}


def _read(path: Path, limit: int, what: str) -> bytes:
    from cudahook.platform import safeio

    try:
        return safeio.read_bytes(path, limit)
    except FileNotFoundError:
        raise SignatureRefused(f"{what} {one_line(str(path))}: no such file") from None
    except safeio.FileRefused as exc:
        raise SignatureRefused(f"{what}: {exc}") from exc
    except OSError as exc:
        raise SignatureRefused(f"{what} {one_line(str(path))}: {exc.strerror}") from exc


def load_private(path: Path) -> Any:
    """The operator's signing key (read before anything is checkpointed)."""
    serialization, ed25519 = _crypto()
    data = _read(path, MAX_KEY_BYTES, "signing key")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"signing key {one_line(str(path))}: not an unencrypted PEM private "
                         "key") from exc
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise UsageError(f"signing key {one_line(str(path))}: not an Ed25519 key")
    return key


def load_public(path: Path) -> Any:
    serialization, ed25519 = _crypto()
    data = _read(path, MAX_KEY_BYTES, "trusted key")
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"trusted key {one_line(str(path))}: not a PEM public key") from exc
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise UsageError(f"trusted key {one_line(str(path))}: not an Ed25519 key")
    return key


def trusted_keys(paths: list[Path], directory: str | None) -> list[Any]:
    """The public keys this node trusts: those given, and every `*.pub` in
    the operator's trusted-keys directory (regular files only)."""
    keys = [load_public(p) for p in paths]
    if directory:
        d = Path(directory)
        try:
            names = sorted(e.name for e in os.scandir(d) if e.name.endswith(".pub"))
        except FileNotFoundError:
            names = []
        except OSError as exc:
            raise UsageError(f"migrate_trusted_keys_dir {one_line(directory)}: "
                             f"{exc.strerror}") from exc
        if len(names) > MAX_TRUSTED:
            raise UsageError(f"migrate_trusted_keys_dir {one_line(directory)}: more than "
                             f"{MAX_TRUSTED} keys")
        keys += [load_public(d / n) for n in names]
    return keys


def sign(archive: Path, digest: str, size: int, container: str, key: Any) -> Path:
    """ARCHIVE.sig: the statement (digest, size, time, container) and its
    signature with `key`."""
    statement = json.dumps({"format": FORMAT, "archive": archive.name, "sha256": digest,
                            "size": size, "signed_at": int(time.time()),
                            "container": container}, sort_keys=True)
    sig = key.sign(statement.encode())
    doc = {"statement": statement, "signature": base64.b64encode(sig).decode(),
           "key_id": key_id(_public_raw(key.public_key()))}
    path = signature_path(archive)
    from cudahook.platform.atomic import write_atomic

    write_atomic(path, (json.dumps(doc, indent=1) + "\n").encode(), 0o644)
    return path


def verify(archive: Path, keys: list[Any], digest: str, size: int) -> dict[str, Any]:
    """The signed statement of ARCHIVE.sig, checked: made by one of `keys`,
    about exactly this archive (its sha256 and size). SignatureRefused if not."""
    from cudahook.platform import safeio

    _crypto()  # a clear refusal when the package is missing
    from cryptography.exceptions import InvalidSignature
    path = signature_path(archive)
    try:
        doc = safeio.parse_json(_read(path, MAX_SIG_BYTES, "signature"), path.name)
    except safeio.FileRefused as exc:
        raise SignatureRefused(str(exc)) from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("statement"), str) \
            or not isinstance(doc.get("signature"), str):
        raise SignatureRefused(f"{path.name}: not a cudahook signature")
    try:
        sig = base64.b64decode(doc["signature"], validate=True)
    except ValueError:
        raise SignatureRefused(f"{path.name}: the signature is not base64") from None
    signed = doc["statement"].encode()
    for key in keys:
        try:
            key.verify(sig, signed)
        except (InvalidSignature, ValueError):  # ValueError: a signature of the wrong length
            continue
        break
    else:
        raise SignatureRefused(f"{path.name}: not signed by a trusted key (the archive's origin "
                               "is not proven)")
    try:
        statement = json.loads(signed)
    except ValueError:
        raise SignatureRefused(f"{path.name}: the signed statement is not JSON") from None
    if not isinstance(statement, dict) or statement.get("format") != FORMAT:
        raise SignatureRefused(f"{path.name}: not a cudahook signature")
    if statement.get("sha256") != digest or statement.get("size") != size:
        raise SignatureRefused(f"{path.name}: signed for another archive (sha256 or size "
                               "differs): the archive was replaced or changed")
    return {"key_id": key_id(_public_raw(key)),
            "signed_at": statement.get("signed_at"),
            "container": one_line(str(statement.get("container")), 300)}
