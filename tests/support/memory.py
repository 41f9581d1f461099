"""A process's resident memory from /proc (Linux), for tests that bound what a server holds:

    reset_peak(pid); ...; grown = peak_rss(pid) - before

peak_rss is VmHWM, the most resident at once since the process started or reset_peak (writing
5 to /proc/PID/clear_refs resets it)."""

from __future__ import annotations


def _status(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def rss(pid: int) -> int:
    """Resident bytes now."""
    return _status(pid, "VmRSS")


def peak_rss(pid: int) -> int:
    """The most resident bytes since start or reset_peak."""
    return _status(pid, "VmHWM")


def reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")
