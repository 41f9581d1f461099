"""StepProfiler: torch's profiler around the engine's steps (SGLang's /start_profile).

torch's profiler records the ops of the thread that starts it, and the model runs in the
worker thread, so a start or stop asked for over HTTP is left here as a command that the worker
carries out between two steps (Worker._loop calls `service` and `after_step`). A profile ends
at a stop, after `num_steps` steps, or when the engine stops; its trace is written then, as
`<output_dir>/[<prefix>-]<profile_id>-TP-0.trace.json.gz` (SGLang's name for rank 0), which
Perfetto and chrome://tracing open.

Every profile is bounded: at most MAX_STEPS steps (DEFAULT_STEPS when the request names none),
MAX_SECONDS of wall time and MAX_GROWTH_BYTES of resident memory grown since it started (what
torch's profiler holds in memory until the export); the first bound reached stops it. The
recording stops on the worker thread (torch's profiler records the thread that started it);
the export, which takes seconds for a long profile, runs on another thread (the /stop_profile
request's, or a thread of its own when a bound stopped it), so generation goes on meanwhile.
Once the trace is written the profile's events are freed and their heap handed back to the OS
(heap.release_freed: glibc kept ~1 GB of a 60-step profile resident after its export).

Not bounded here: torch's stop post-processes every recorded event on the thread that started
the profile, holding the GIL (5.6 s for 60 steps with with_stack, which records every Python
call, SGLang's default): the engine and the event loop wait for it once, at the stop.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from grctl import confined, heap
from grctl.engine.gate import Gate
from grctl.errors import Conflict, NotReady, ValidationError

log = logging.getLogger("grctl.engine")

ACTIVITIES = ("CPU", "GPU", "MEM")  # SGLang's names that grctl records (MEM: allocations too)
DEFAULT_STEPS = 100  # a profile that names no num_steps stops after these many steps
MAX_STEPS = 10_000
MAX_SECONDS = 600.0
MAX_GROWTH_BYTES = 1 << 30  # resident memory grown since the profile started


def resident_bytes() -> int:
    """This process's resident memory (0 where /proc is not there: no byte bound then)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@dataclass(frozen=True)
class ProfileRequest:
    output_dir: str
    profile_id: str
    activities: tuple[str, ...] = ("CPU", "GPU")
    num_steps: int | None = None  # stop by itself after this many steps
    start_step: int | None = None  # start once the engine has run this many steps
    with_stack: bool = True
    record_shapes: bool = True
    prefix: str | None = None

    @property
    def trace_path(self) -> Path:
        name = f"{self.prefix}-{self.profile_id}" if self.prefix else self.profile_id
        return Path(self.output_dir) / f"{name}-TP-0.trace.json.gz"


def torch_activities(req: ProfileRequest, device: torch.device) -> list[ProfilerActivity]:
    """SGLang's activity names as torch's; GPU on a CPU server records nothing more."""
    unknown = [a for a in req.activities if a not in ACTIVITIES]
    if unknown:
        raise ValidationError(
            f"profiler activities {unknown} are not recorded by grctl",
            hint=f"use any of {', '.join(ACTIVITIES)}",
        )
    out = [ProfilerActivity.CPU] if {"CPU", "MEM"} & set(req.activities) else []
    if "GPU" in req.activities and device.type == "cuda":
        out.append(ProfilerActivity.CUDA)
    if not out:
        raise ValidationError(
            f"nothing to record: activities {list(req.activities)} on a {device.type} server",
            hint="add CPU",
        )
    return out


class StepProfiler:
    """At most one profile at a time. start and stop are called from request threads and wait
    for the worker; service, after_step and close run on the worker thread only."""

    def __init__(self, device: torch.device, gate: Gate):
        self.device = device
        self.gate = gate  # notified to wake an idle worker; says whether it runs
        self._lock = threading.Lock()
        self._command: tuple[str, ProfileRequest | None, Future] | None = None
        self._armed: ProfileRequest | None = None  # waiting for its start_step
        self._active: ProfileRequest | None = None
        self._prof: profile | None = None
        self._num_profiled = 0
        self._started_at = 0.0
        self._rss_at_start = 0
        self._exporting: threading.Thread | None = None  # a bound's export, on its own thread
        self.num_steps = 0  # steps the engine has run

    # ---- the request side ---------------------------------------------------------------
    def start(self, req: ProfileRequest, timeout: float = 30.0) -> None:
        """Start profiling (at once, or once the engine has run req.start_step steps)."""
        torch_activities(req, self.device)
        if req.num_steps is not None and not 1 <= req.num_steps <= MAX_STEPS:
            raise ValidationError(f"num_steps must be in [1, {MAX_STEPS}], got {req.num_steps}")
        self._require_worker("nothing to profile")
        with self._lock:
            if self._command is not None or self._armed is not None or self._active is not None:
                raise Conflict("profiling is already in progress", hint="call /stop_profile first")
            if self._exporting is not None and self._exporting.is_alive():
                raise Conflict(
                    "the last profile's trace is still being written", hint="retry in a moment"
                )
            if req.start_step is not None and req.start_step > self.num_steps:
                self._armed = req
                return
            fut: Future = Future()
            self._command = ("start", req, fut)
        self._wait(fut, timeout)

    def stop(self, timeout: float = 300.0) -> Path | None:
        """Stop and write the trace; its path (None: the profile had not started yet)."""
        self._require_worker("no profile is running")
        with self._lock:
            if self._armed is not None:
                self._armed = None
                return None
            if self._active is None or self._command is not None:
                raise Conflict("profiling is not in progress", hint="call /start_profile first")
            fut: Future = Future()
            self._command = ("stop", None, fut)
        stopped = self._wait(fut, timeout)  # the recording stopped on the worker thread
        del fut  # it held the profile too
        return _export(*stopped)  # written here, while the engine steps on

    def _require_worker(self, what: str) -> None:
        if not self.gate.worker_alive:
            raise NotReady(f"the engine's worker is not running: {what}")

    def _wait(self, fut: Future, timeout: float):
        with self.gate:
            self.gate.notify()  # an idle worker wakes and carries the command out
        try:
            return fut.result(timeout)
        except FutureTimeout as exc:
            raise NotReady(f"the engine's worker did not reach the profiler in {timeout}s") from exc

    def has_command(self) -> bool:
        return self._command is not None

    # ---- the worker side (every change of state holding the lock) ------------------------
    def service(self) -> None:
        with self._lock:
            command, self._command = self._command, None
            if command is None:
                return
            kind, req, fut = command
            try:
                fut.set_result(self._begin(req) if kind == "start" else self._stop_recording())
            except Exception as exc:
                fut.set_exception(exc)

    def after_step(self) -> None:
        with self._lock:
            self.num_steps += 1
            armed = self._armed
            if armed is not None and self.num_steps >= (armed.start_step or 0):
                self._armed = None
                try:
                    self._begin(armed)
                except Exception:
                    log.exception("profiler failed to start at step %d", self.num_steps)
            elif self._active is not None:
                self._num_profiled += 1
                if self._over_bounds():
                    stopped = self._stop_recording()
                    self._exporting = threading.Thread(
                        target=_export, args=stopped, name="grctl-profile-export", daemon=True
                    )
                    self._exporting.start()

    def _over_bounds(self) -> bool:
        req = self._active
        assert req is not None
        if self._num_profiled >= (req.num_steps or DEFAULT_STEPS):
            return True
        if time.monotonic() - self._started_at > MAX_SECONDS:
            log.warning("profile %s stopped after %.0f s (its bound)", req.profile_id, MAX_SECONDS)
            return True
        grown = resident_bytes() - self._rss_at_start
        if self._rss_at_start and grown > MAX_GROWTH_BYTES:
            log.warning("profile %s stopped: memory grew by %d bytes", req.profile_id, grown)
            return True
        return False

    def close(self) -> None:
        """The engine stops: a queued command fails, a running profile writes its trace."""
        with self._lock:
            command, self._command, self._armed = self._command, None, None
            if command is not None:
                command[2].set_exception(NotReady("the engine stopped before the profiler ran"))
            if self._active is not None:
                _export(*self._stop_recording())

    def _begin(self, req: ProfileRequest) -> None:
        prof = profile(
            activities=torch_activities(req, self.device),
            record_shapes=req.record_shapes,
            with_stack=req.with_stack,
            profile_memory="MEM" in req.activities,
        )
        self._rss_at_start = resident_bytes()
        prof.start()
        self._prof, self._active, self._num_profiled = prof, req, 0
        self._started_at = time.monotonic()
        log.info("profiling started (%s)", req.profile_id)

    def _stop_recording(self) -> tuple[profile, Path]:
        prof, req = self._prof, self._active
        assert prof is not None and req is not None
        self._prof = self._active = None
        prof.stop()
        return prof, req.trace_path


def _export(prof: profile, path: Path) -> Path:
    """Write a stopped profile's trace (seconds for a long one: never on the worker thread),
    then free its events and hand their heap back to the OS."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # renamed whole: never seen half; a random name made with O_EXCL|O_NOFOLLOW (a symlink
    # planted at a predictable one would have the trace written through it)
    fd, partial = confined.make_temp(path.parent, f".{path.name}.", ".partial.json.gz")
    os.close(fd)
    try:
        try:  # torch's Python writer: the GIL is let go between events (the C++ one holds it)
            prof.export_chrome_trace(str(partial), use_python_export=True)
        except TypeError:  # a torch without it
            prof.export_chrome_trace(str(partial))
        os.chmod(partial, 0o644)  # mkstemp's 0600: a trace is as readable as it was
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
        _free(prof)
        heap.release_freed()
    log.info("profile written to %s", path)
    return path


def _free(prof: profile) -> None:
    """Drop the recorded events now (a caller's reference to the profile may outlive this)."""
    inner = getattr(prof, "profiler", None)
    if inner is not None and hasattr(inner, "kineto_results"):
        inner.kineto_results = None
