"""The CPU kernels' build (gpu/cpu_kernels.py): every source in gpu/kernels/*.c builds warning-free with each flag
set, a built library is loaded from the cache folder without a rebuild, and a kernel that cannot be built is None
(its caller runs plain torch); a hanging compiler is given up at the deadline."""

from __future__ import annotations

import shutil
import subprocess
from importlib import resources

import pytest

from loraledger.gpu import cpu_kernels

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler (cc)")
SOURCES = sorted(
    p.name for p in resources.files("loraledger.gpu").joinpath("kernels").iterdir() if p.name.endswith(".c")
)


@pytest.fixture(autouse=True)
def _fresh(fresh_cpu_kernels):
    """No kernel cached from an earlier test (tests/gpu/conftest.py)."""


def test_the_sources_are_found():
    assert {
        "lora_cpu.c",
        "argmax_cpu.c",
        "attention_cpu.c",
        "rms_norm_cpu.c",
        "activation_cpu.c",
        "rotary_cpu.c",
    } <= set(SOURCES)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("flags", cpu_kernels.FLAG_SETS, ids=" ".join)
def test_each_source_builds_without_warnings(tmp_path, flags, source):
    path = resources.files("loraledger.gpu").joinpath("kernels", source)
    result = subprocess.run(
        ["cc", *flags, "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-o", str(tmp_path / "k.so"), str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("source", SOURCES)
def test_built_once_then_loaded_from_the_cache(monkeypatch, source):
    first = cpu_kernels.library(source)
    assert first is not None and first[1].exists()
    assert first[1].is_relative_to(cpu_kernels.paths.cache_dir()) and first[1].name.startswith(source[:-2] + "-")
    cpu_kernels.library.cache_clear()

    def no_build(*args, **kwargs):
        raise AssertionError("rebuilt although the cached library is there")

    monkeypatch.setattr(cpu_kernels.subprocess, "run", no_build)
    assert cpu_kernels.library(source)[1] == first[1]


@pytest.mark.parametrize("how", ["disabled", "no compiler", "compiler fails", "compiler hangs"])
def test_where_a_kernel_cannot_be_built_it_is_none(monkeypatch, tmp_path, how):
    if how == "disabled":
        monkeypatch.setenv(cpu_kernels.DISABLE_ENV, "0")
    elif how == "no compiler":
        monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    else:
        script = "exec sleep 30" if how == "compiler hangs" else "echo 'cc: internal error' >&2; exit 3"
        fake = tmp_path / "fake-cc"
        fake.write_text(f"#!/bin/sh\necho run >> {tmp_path / 'runs'}\n{script}\n")
        fake.chmod(0o755)
        monkeypatch.setenv("CC", str(fake))
        monkeypatch.setenv("LORALEDGER_HOME", str(tmp_path / "home"))  # no cached library from another test
        monkeypatch.setattr(cpu_kernels, "BUILD_SECONDS", 1)
    assert cpu_kernels.library("argmax_cpu.c") is None
    if how == "compiler hangs":  # the deadline ends the build, and no other flags are tried after it
        assert (tmp_path / "runs").read_text().count("run") == 1
    elif how == "compiler fails":  # every flag set was tried
        assert (tmp_path / "runs").read_text().count("run") == len(cpu_kernels.FLAG_SETS)


def test_a_changed_header_builds_anew(monkeypatch, tmp_path):
    """The headers the sources include are part of the cache key: editing cpu_vectors.h must not load a stale build."""
    source = b"int f(void) { return 0; }"
    one = cpu_kernels._library_path("k.c", source, {"cpu_vectors.h": b"a"}, "/usr/bin/cc", ("-O3",))
    two = cpu_kernels._library_path("k.c", source, {"cpu_vectors.h": b"b"}, "/usr/bin/cc", ("-O3",))
    assert one != two
