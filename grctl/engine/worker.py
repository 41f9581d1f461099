"""Worker: the background thread, the step it runs, and how a request ends.

A step takes its batch from the scheduler holding the gate, computes without it (the gate says
it is computing meanwhile), and publishes its outcome holding it again. A request ends at once,
or, when the step computing it is running, as soon as that step's outcome lands. Its result (a
beam search's per-token top logprobs read back into lists can take seconds) is built by the
worker thread without the gate, between steps: a request that ends holding the gate only leaves
the scheduler, so /ready, /poll and every other caller of the gate wait for none of that.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from grctl.engine import output_kv
from grctl.engine.executor import Executor
from grctl.engine.gate import Gate
from grctl.engine.prefix_cache import weights_tag
from grctl.engine.profiler import StepProfiler
from grctl.engine.results import ResultStore, result_nbytes
from grctl.engine.scheduler import Scheduler
from grctl.engine.sequence import Sequence, Status
from grctl.engine.stats import EngineStats
from grctl.model.device import bind_thread

log = logging.getLogger("grctl.engine")


class Worker:
    def __init__(
        self,
        gate: Gate,
        scheduler: Scheduler,
        executor: Executor,
        results: ResultStore,
        stats: EngineStats,
        device: torch.device,
        profiler: StepProfiler,
    ):
        self.gate = gate
        self.scheduler = scheduler
        self.executor = executor
        self.results = results
        self.stats = stats
        self.device = device
        self.profiler = profiler  # started and stopped in this thread, between steps
        self._thread: threading.Thread | None = None
        self._step_ids: set[str] = set()  # the requests of the step being computed
        self._unbuilt: list[tuple[Sequence, str, bool]] = []  # ended: (seq, label, aborted)

    # ---- the thread ---------------------------------------------------------------------
    def start(self) -> None:
        self.gate.worker_running(True)
        self._thread = threading.Thread(target=self._loop, name="grctl-engine", daemon=True)
        self._thread.start()

    def stop(self, drain: bool, timeout: float) -> None:
        """Stop the thread; with `drain`, first wait up to `timeout` for what can still finish."""
        deadline = time.monotonic() + timeout
        gate = self.gate
        with gate:
            if drain and gate.worker_alive:  # while paused nothing could finish: no wait
                gate.wait_for(
                    lambda: not self.scheduler.num_in_flight or not gate.can_progress(), timeout
                )
            gate.stop()
            self.abort_all()
        if self._thread is not None:
            self._thread.join(max(0.0, deadline - time.monotonic()))

    def _loop(self) -> None:
        bind_thread(self.device)  # a new thread starts on cuda:0 whatever the model's device
        try:
            while True:
                with self.gate:
                    self.gate.wait_for(
                        lambda: (
                            self.gate.is_stopping
                            or self._has_work()
                            or self.profiler.has_command()
                            or bool(self._unbuilt)
                        ),
                        1.0,
                    )
                    if self.gate.is_stopping:
                        return
                self.build_results()
                self.profiler.service()
                try:
                    if self.run_step():
                        self.profiler.after_step()
                    else:
                        time.sleep(0.001)
                except Exception as exc:  # a bug outside the model step: keep serving
                    log.exception("engine worker step failed")
                    self.stats.record_error(exc)
        finally:
            self.profiler.close()
            self.gate.worker_running(False)  # from here a request that ends builds its own
            self.build_results()

    def _has_work(self) -> bool:
        return self.gate.can_compute() and self.scheduler.num_in_flight > 0

    # ---- the step -----------------------------------------------------------------------
    def run_step(self) -> bool:
        """One step: admit and prefill, then decode every running request. False when there
        was nothing to do."""
        gate = self.gate
        with gate:
            if not gate.can_compute():
                return False
            prefill, decode = self.scheduler.schedule()
            step = prefill + decode
            if not step:
                return False
            gate.begin_step()
            self._step_ids = {s.request_id for s in step}
            label = gate.label
            cache_tag = weights_tag(label, gate.generation)
        t0, error, failed = time.perf_counter(), None, ()
        before = {id(s): progress(s) for s in step}
        try:
            self.executor.run(prefill, decode, label, cache_tag)
        except Exception as exc:
            error = exc
            failed = self._isolate(prefill, decode, before, label, cache_tag)
            log.exception(
                "engine step failed; %d of its %d requests end with finish_reason abort",
                len(failed),
                len(step),
            )
        culprits = self.executor.take_culprits()  # failed alone (stop strings, their own KV)
        if culprits:
            error = error or next(iter(culprits.values()))
            failed = set(failed) | set(culprits)
            log.error(
                "%d of a step's %d requests failed alone and end with finish_reason abort: %r",
                len(culprits),
                len(step),
                error,
            )
        with gate:
            gate.end_step()
            self._step_ids = set()
            self.stats.record_step(time.perf_counter() - t0, error)
            for seq in step:
                if seq.status is not Status.FINISHED and (
                    id(seq) in failed or seq.abort_requested or seq.is_done
                ):
                    # an abort that finds the request ending in this very step (its item
                    # completed, its last token) lets it finish: SGLang's abort finds it gone
                    aborted = seq.abort_requested and not seq.is_done
                    self.finish(seq, aborted=id(seq) in failed or aborted)
        return True

    def _isolate(
        self,
        prefill: list[Sequence],
        decode: list[Sequence],
        before: dict[int, tuple],
        label: str,
        cache_tag: str,
    ) -> set[int]:
        """After a failed step, run each of its requests alone, so that only the ones that fail
        by themselves end (-> their ids). A new request whose first-token selection failed
        starts again (its prefill is then an exact repeat in the prefix cache); one whose prefill
        and first token went through decodes alone; a request the failed selection did not
        advance runs its step again with its generator rewound, so it draws what it would have
        drawn. One whose beams the failed step advanced cannot run the step again and ends."""
        failed, marks = set(), self.executor.marks()  # the failed step's, not a re-run's
        for seq, is_new in [(s, True) for s in prefill] + [(s, False) for s in decode]:
            cached = seq.cached_tokens
            if is_new and seq.beams is not None and not seq.beams.is_started:
                seq.beams = seq.ctx = seq.beam_kv = None  # the selection failed: start again
            if progress(seq) == before[id(seq)]:
                alone = ([seq], []) if is_new else ([], [seq])
            elif is_new and seq.beams.num_steps == 1:  # started; its first decode never ran
                if seq.is_done or id(seq) in self.executor.culprits:
                    continue
                alone = ([], [seq])
            else:
                failed.add(id(seq))
                continue
            self.executor.rewind(seq, marks)
            try:
                self.executor.run(*alone, label, cache_tag)
            except Exception:
                failed.add(id(seq))
            if is_new:
                seq.cached_tokens = cached  # what the first attempt found, not its own repeat
        return failed

    # ---- how a request ends (holding the gate) ------------------------------------------
    def abort(self, seq: Sequence) -> None:
        if self.gate.is_computing and seq.request_id in self._step_ids:
            seq.abort_requested = True  # ended when the step's outcome lands
        else:
            self.finish(seq, aborted=True)
        self.gate.notify()

    def abort_all(self) -> int:
        seqs = self.scheduler.all_sequences()
        for seq in seqs:
            self.abort(seq)
        return len(seqs)

    def finish(self, seq: Sequence, aborted: bool = False) -> None:
        """End it (holding the gate). While the worker thread runs, it builds the result
        without the gate (build_results); else (steps driven by hand) it is built here."""
        self.scheduler.remove(seq)
        seq.release_kv()
        if self.gate.worker_alive:
            self.results.expect(seq.request_id)
            self._unbuilt.append((seq, self.gate.label, aborted))
            self.gate.notify()
        else:
            result = seq.to_result(self.gate.label, aborted)
            output_kv.insert(self.executor.cache, seq, result.output_ids, result.finish_reason)
            self._store(result)

    def build_results(self) -> None:
        """Build the results of the requests that ended, without the gate; each is put (and
        its waiters woken) holding it for that only."""
        with self.gate:
            todo, self._unbuilt = self._unbuilt, []
        for seq, label, aborted in todo:
            result, error, nbytes = None, None, None
            try:
                result = seq.to_result(label, aborted)
                nbytes = result_nbytes(result)  # sized off the gate too
                # before it is stored: whoever it wakes may continue it (engine/stages.py)
                output_kv.insert(self.executor.cache, seq, result.output_ids, result.finish_reason)
            except Exception as exc:  # a bug: the request ends without a result (404)
                log.exception("building the result of %s failed", seq.request_id)
                error = exc
            with self.gate:
                if result is None:
                    self.results.forget(seq.request_id)
                    self.stats.record_error(error)
                else:
                    self._store(result, nbytes)
                self.gate.notify()

    def _store(self, result, nbytes: int | None = None) -> None:
        self.results.put(result, nbytes)
        self.stats.record_result(result)


def progress(seq: Sequence) -> tuple:
    """Where a request's search stands: changes whenever a step moves it."""
    beams = seq.beams
    return (id(beams), -1 if beams is None else beams.num_steps)
