"""What a weight sync reports: one ServerOutcome per server, a SyncResult, SyncError and
SyncInterrupted.

A failed server is named with the stage it failed in (connect, plan, pause, flush, push,
continue, verify) and why; the others keep their own outcome, so one error says what happened
everywhere. A server that took some but not all of a tensor push is *partial*: it is never
resumed, whatever stopped the sync (an error, Ctrl-C, SIGTERM).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field

from grctl.errors import GrctlError, Unauthorized

STAGES = ("connect", "plan", "pause", "flush", "begin", "push", "end", "continue", "verify")
TRANSPORTS = ("tensor", "disk")  # WeightSync(transport=...)


@dataclass
class ServerOutcome:
    url: str
    old_version: str | None = None
    weight_version: str | None = None  # what the server reported at the end, when known
    device: str = ""
    gpu_uuid: str | None = None
    dtype: str = ""
    failed_stage: str | None = None  # one of STAGES
    error: str | None = None
    resumed: bool = False
    paused: bool = False  # this sync asked it to pause
    num_buckets: int = 0  # tensor chunks this server applied (acknowledged)
    buckets_total: int = 0  # tensor chunks planned for it
    uncertain: bool = False  # a chunk was sent but no reply came: it may have been applied
    label_counts: dict[str, int] | None = None  # from /get_weight_version, for a partial server
    num_bytes: int = 0
    num_tensors: int = 0  # tensors loaded, as the server counted them
    verified: bool | None = None  # None: not checked
    mismatches: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)  # stage -> seconds

    @property
    def ok(self) -> bool:
        return self.failed_stage is None

    @property
    def is_partial(self) -> bool:
        """Some of the push may be on the server, and not all of it."""
        return (self.num_buckets > 0 or self.uncertain) and self.num_buckets < self.buckets_total

    def left_state(self) -> str:
        """'paused, 3 of 9 buckets applied (and one more may be), labels {...}'."""
        state = "resumed" if self.resumed else ("paused" if self.paused else "not paused")
        text = f"{state}, {self.num_buckets} of {self.buckets_total} buckets applied"
        if self.uncertain:
            text += " (one more was in flight and may be applied)"
        if self.label_counts:
            text += ", labels " + ", ".join(f"{k}: {n}" for k, n in self.label_counts.items())
        return text

    def fail(self, stage: str, exc: BaseException | str, where: str = "") -> None:
        if self.failed_stage is None:  # the first failure is the one that matters
            self.failed_stage = stage
            text = describe(exc)
            self.error = f"{where}: {text}" if where else text

    def summary(self) -> str:
        if self.ok:
            return f"{self.url}: ok (version {self.weight_version})"
        return f"{self.url}: {self.failed_stage} failed ({self.error}); {self.left_as()}"

    def left_as(self) -> str:
        """What the failure left on this server, as far as the client knows."""
        if self.failed_stage == "connect":
            return "never reached, so nothing changed there"
        kept = f"version {self.weight_version}" if self.weight_version else "version unknown"
        if self.failed_stage == "plan":
            return f"refused before any pause, nothing changed ({kept})"
        if self.is_partial:
            return f"{self.left_state()}: partly new weights, push again to finish"
        if self.resumed:
            return f"resumed, {kept}"
        if self.failed_stage == "pause":
            return f"not paused, nothing changed ({kept})"
        return f"NOT resumed: check it, then `grctl resume`, {kept}"


def describe(exc: BaseException | str) -> str:
    """An error as one line, with what to do for the ones a CLI user causes most."""
    if isinstance(exc, Unauthorized):
        return f"{exc} (pass the server's key with --api-key or GR_API_KEY)"
    if isinstance(exc, (GrctlError, str)):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


@dataclass
class Progress:
    """Tensor-push progress, reported after each bucket (bytes count once, not per server)."""

    buckets_done: int
    buckets_total: int
    bytes_done: int
    bytes_total: int
    seconds: float


@dataclass
class SyncResult:
    weight_version: str | None
    transport: str  # one of TRANSPORTS
    checkpoint: str
    servers: list[ServerOutcome]
    num_buckets: int = 0
    num_bytes: int = 0
    timings: dict[str, float] = field(default_factory=dict)  # stage -> seconds, fleet-wide
    interrupted_by: str | None = None  # "SIGINT", "SIGTERM", "SIGHUP" or "SIGQUIT": what stopped it

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.servers)

    @property
    def failed(self) -> list[ServerOutcome]:
        return [s for s in self.servers if not s.ok]

    @property
    def push_gbps(self) -> float:
        seconds = self.timings.get("push", 0.0)
        return self.num_bytes / seconds / 1e9 if seconds > 0 else 0.0


class SyncError(GrctlError):
    """A sync failed on at least one server; `result` holds every server's outcome."""

    code, status = "sync_failed", 0

    def __init__(self, result: SyncResult):
        failed = result.failed
        target = result.weight_version or "(unchanged label)"
        message = (
            f"weight sync to version {target} failed on {len(failed)} of "
            f"{len(result.servers)} server(s): " + "; ".join(s.summary() for s in result.servers)
        )
        super().__init__(message)
        self.result = result


class Terminated(KeyboardInterrupt):
    """SIGTERM (or SIGHUP, SIGQUIT: a closed terminal, Ctrl-\\), raised by the CLI's handler so
    a push stops the way Ctrl-C stops it."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)


def stopped_by(exc: KeyboardInterrupt) -> str:
    """The signal's name for SyncResult.interrupted_by: a Terminated's own, else SIGINT."""
    return signal.Signals(exc.signum).name if isinstance(exc, Terminated) else "SIGINT"


def exit_code(interrupted_by: str | None) -> int:
    """A shell's code for a process its signal stopped: 128 + the signal's number."""
    return 128 + int(signal.Signals[interrupted_by or "SIGINT"])


class SyncInterrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) stopped a sync. Still a KeyboardInterrupt; `result` says what state
    each server was left in (partial servers stay paused)."""

    def __init__(self, result: SyncResult):
        super().__init__(f"weight sync interrupted by {result.interrupted_by}")
        self.result = result
