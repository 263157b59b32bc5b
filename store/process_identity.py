"""Which engine processes are certainly gone: a process key names one process on one machine, and can be checked there.

A lease is the rule between machines: a peer is taken for dead only once its lease has expired. On
the machine (and in the PID namespace) where an instance ran, a restarted engine can know more, at
once: the process is gone when no process has its PID, or when the one that has it started at
another time (the PID was reused). Inside one process an engine that stopped without releasing its
lease (its store went down at stop) is gone when this process no longer runs it. The key is
`<boot id>/<pid namespace>/<pid>/<start time in clock ticks>` on Linux; elsewhere there is none, and
only the lease decides.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

_running_here: set[str] = set()  # the instance ids whose engine runs in this process now


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _start_ticks(pid: int) -> str | None:
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return fields[19] if len(fields) > 19 and fields[0] != "Z" else None  # field 22 of proc(5); a zombie is gone


@functools.cache
def _machine() -> str | None:
    boot = _read("/proc/sys/kernel/random/boot_id")
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    return None if boot is None else f"{boot}/{namespace}"


def process_key() -> str | None:
    """This process's key (None where /proc cannot tell)."""
    machine, ticks = _machine(), _start_ticks(os.getpid())
    return None if machine is None or ticks is None else f"{machine}/{os.getpid()}/{ticks}"


def mark_running(instance_id: str, running: bool) -> None:
    """Say whether this process runs instance_id's engine now."""
    if running:
        _running_here.add(instance_id)
    else:
        _running_here.discard(instance_id)


def certainly_gone(instance_id: str, key: str | None) -> bool:
    """True only when the instance's process is known to be gone (on this machine, in this PID namespace)."""
    machine = _machine()
    if key is None or machine is None or not key.startswith(machine + "/"):
        return False
    pid_text, _, ticks = key[len(machine) + 1 :].partition("/")
    if not pid_text.isdigit():
        return False
    pid = int(pid_text)
    if pid == os.getpid() and ticks == _start_ticks(pid):
        return instance_id not in _running_here
    return _start_ticks(pid) != ticks
