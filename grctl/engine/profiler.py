"""StepProfiler: torch's profiler around the engine's steps (SGLang's /start_profile).

torch's profiler records the ops of the thread that starts it, and the model runs in the
worker thread, so a start or stop asked for over HTTP is left here as a command that the worker
carries out between two steps (Worker._loop calls `service` and `after_step`). A profile ends
at a stop, after `num_steps` steps, or when the engine stops; its trace is written then, as
`<output_dir>/[<prefix>-]<profile_id>-TP-0.trace.json.gz` (SGLang's name for rank 0), which
Perfetto and chrome://tracing open.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from grctl.engine.gate import Gate
from grctl.errors import Conflict, NotReady, ValidationError

log = logging.getLogger("grctl.engine")

ACTIVITIES = ("CPU", "GPU", "MEM")  # SGLang's names that grctl records (MEM: allocations too)


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
        self.num_steps = 0  # steps the engine has run

    # ---- the request side ---------------------------------------------------------------
    def start(self, req: ProfileRequest, timeout: float = 30.0) -> None:
        """Start profiling (at once, or once the engine has run req.start_step steps)."""
        torch_activities(req, self.device)
        self._require_worker("nothing to profile")
        with self._lock:
            if self._command is not None or self._armed is not None or self._active is not None:
                raise Conflict("profiling is already in progress", hint="call /stop_profile first")
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
        return self._wait(fut, timeout)

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
                fut.set_result(self._begin(req) if kind == "start" else self._finish())
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
            elif self._active is not None and self._active.num_steps is not None:
                self._num_profiled += 1
                if self._num_profiled >= self._active.num_steps:
                    self._finish()

    def close(self) -> None:
        """The engine stops: a queued command fails, a running profile writes its trace."""
        with self._lock:
            command, self._command, self._armed = self._command, None, None
            if command is not None:
                command[2].set_exception(NotReady("the engine stopped before the profiler ran"))
            if self._active is not None:
                self._finish()

    def _begin(self, req: ProfileRequest) -> None:
        prof = profile(
            activities=torch_activities(req, self.device),
            record_shapes=req.record_shapes,
            with_stack=req.with_stack,
            profile_memory="MEM" in req.activities,
        )
        prof.start()
        self._prof, self._active, self._num_profiled = prof, req, 0
        log.info("profiling started (%s)", req.profile_id)

    def _finish(self) -> Path:
        prof, req = self._prof, self._active
        assert prof is not None and req is not None
        self._prof = self._active = None
        prof.stop()
        path = req.trace_path
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))
        log.info("profile written to %s", path)
        return path
