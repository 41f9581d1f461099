"""Engine: the generation API the server calls, composed of its parts.

Requests are submitted, polled, fetched and cancelled here; pause, the exclusive section of a
weight write, what the weights side reports it wrote, the cache flush and memory moves are
decided here, each holding the Gate (gate.py), which callers read for the weights' state. The
Worker (worker.py) runs the steps; status.py reports them, catalog_swap.py installs a catalog.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from grctl.engine import prompt_logprobs, status
from grctl.engine.context_attention import InvariantContext
from grctl.engine.executor import Executor
from grctl.engine.gate import PAUSE_MODES, Gate
from grctl.engine.kv_cache import (
    kv_bytes_budget,
    request_kv_bytes,
    sampling_mask_bytes,
    top_logprobs_bytes,
)
from grctl.engine.memory import MemorySaver
from grctl.engine.model_runner import ModelRunner
from grctl.engine.prefix_cache import PrefixCache, weights_tag
from grctl.engine.profiler import StepProfiler
from grctl.engine.request import GenerateRequest, GenerateResult, new_request_id
from grctl.engine.results import ResultStore
from grctl.engine.scheduler import Scheduler
from grctl.engine.sequence import Sequence
from grctl.engine.stats import EngineStats
from grctl.engine.validation import (
    context_limit,
    excluded_of,
    item_start_of,
    stop_ids_of,
    validate_request,
)
from grctl.engine.worker import Worker
from grctl.errors import (
    Conflict,
    DuplicateRequestId,
    GenerateTimeout,
    NotFound,
    Overloaded,
    ValidationError,
)
from grctl.model.device import resolve_device
from grctl.model.qwen3 import Qwen3ForCausalLM

if TYPE_CHECKING:
    from grctl.catalog.store import CatalogStore
    from grctl.engine.config import EngineConfig

log = logging.getLogger("grctl.engine")


class Engine:
    """The API the server calls. `run_step()` advances one step by hand when no worker is
    started, which tests use to reach every state deterministically."""

    def __init__(self, model: Qwen3ForCausalLM, config: EngineConfig):
        self.device = resolve_device(config.device, placed=model.embed_tokens.weight.device)
        if model.embed_tokens.weight.device != self.device:
            model.to(self.device)  # at construction only: later, weights are written in place
        self.model = model.eval()
        self.config = config
        self.max_context_len = context_limit(config.max_context_len, model.config)
        self.gate = Gate(config.weight_version, allow_mixed=config.allow_partial_updates)
        self.cache = PrefixCache(
            config.enable_prefill_cache,
            config.prefill_cache_max_entries,
            config.prefill_cache_max_tokens,
            config.prefill_cache_max_bytes,
        )
        self.runner = ModelRunner(model, self.device)
        deterministic = config.deterministic_inference
        model.set_batch_invariant(deterministic)  # before graphs are captured over it
        if deterministic:
            self.runner.context_attention = InvariantContext
        self.executor = Executor(
            self.runner,
            self.cache,
            config.return_original_logprob,
            config.sampling_mask_max_tokens,
            join_contexts=deterministic,
            invariant_rows=deterministic,
        )
        self.scheduler = Scheduler(
            config.max_running_requests,
            config.prefill_token_budget,
            kv_bytes_budget(config, self.device),
            self.kv_bytes_of,
            self.prefill_tokens_of,
        )
        self.results = ResultStore(
            config.max_finished_results, config.max_finished_result_bytes or None
        )
        self.stats = EngineStats()
        # One weight operation at a time, each to its end: an update (the weights side takes
        # this lock for its whole run), a read of the weights, a relabel, a memory release or
        # resume. Never held by a step; the gate's lock is taken inside it, never around it.
        self.weight_ops = threading.Lock()
        self.catalogs: CatalogStore | None = None  # requests are held to its current catalog
        self.memory = MemorySaver(
            self.gate,
            model,
            self.runner,
            self.cache,
            self.device,
            weight_ops=self.weight_ops,
            recapture=config.cuda_graph,
            on_error=self.stats.record_error,
            backup_all=config.enable_weights_cpu_backup,
            preserve=tuple(
                part.strip()
                for part in (config.preserve_parameter_names or "").split(",")
                if part.strip()
            ),
        )
        self.profiler = StepProfiler(self.device, self.gate)  # /start_profile, /stop_profile
        self.worker = Worker(
            self.gate,
            self.scheduler,
            self.executor,
            self.results,
            self.stats,
            self.device,
            self.profiler,
        )

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        if self.gate.worker_alive:
            return
        if self.config.cuda_graph and self.device.type == "cuda" and self.runner.graphs is None:
            try:
                self.runner.capture_graphs()
            except Exception as exc:  # serve eagerly rather than not at all
                log.exception("CUDA graph capture failed; decode runs eagerly")
                self.stats.record_error(exc)
        self.worker.start()

    def stop(self, drain: bool = True, timeout: float = 30.0) -> None:
        self.worker.stop(drain, timeout)

    def run_step(self) -> bool:
        return self.worker.run_step()

    # ---- requests -----------------------------------------------------------------------
    def validate(self, req: GenerateRequest) -> None:
        """The checks a request passes before it is queued (validation.py), against this
        engine's model and limits: a ValidationError says what to change."""
        cfg = self.config
        validate_request(
            req,
            self.model.config,
            max_context_len=self.max_context_len,
            max_beam_width=cfg.max_beam_width,
            max_new_tokens_limit=cfg.max_new_tokens,
        )

    def check_open(self) -> None:
        """Raise why generation is refused now (paused, weights mixed, memory released...), as
        submit would; nothing when it is served."""
        with self.gate:
            refusals = self.gate.refusals()
        if refusals:
            raise refusals[0][1]()

    def submit(self, req: GenerateRequest) -> str:
        self.validate(req)
        self.scheduler.check_fits(req)
        while True:  # the request keeps the catalog served when it is queued, whatever reloads
            catalog = self._served_catalog(req)
            start = item_start_of(req, catalog)
            excluded = excluded_of(req, catalog, self.device, start.depth)  # off the lock
            with self.gate:
                if self._served_catalog(req) is catalog:  # else installed meanwhile: again
                    return self._queue(req, catalog, excluded, start)

    def _served_catalog(self, req: GenerateRequest):
        store = self.catalogs
        return store.current if store is not None and req.sampling.use_catalog else None

    def _queue(self, req: GenerateRequest, catalog, excluded, start) -> str:
        """Queue a validated request (holding the gate), or raise why not."""
        cfg = self.config
        refusals = self.gate.refusals()
        if refusals:
            raise refusals[0][1]()
        rid = req.request_id or new_request_id()
        if rid in self.scheduler or rid in self.results:
            raise DuplicateRequestId(f"request id {rid!r} is already in use")
        if len(self.scheduler.waiting) >= cfg.max_waiting_requests:
            raise Overloaded(
                f"the waiting queue is full ({cfg.max_waiting_requests} requests)",
                hint="retry later",
            )
        seq = Sequence(rid, req, stop_ids_of(req, self.model.config), catalog, *excluded, start)
        self.scheduler.add(seq)
        self.stats.num_submitted += 1
        self.gate.notify()
        return rid

    def kv_bytes_of(self, req: GenerateRequest) -> int:
        """The KV a request holds while it runs, its top logprobs and sampling support, and what
        scoring its prompt holds (admission by --max-kv-bytes)."""
        sp, cfg = req.sampling, self.model.config
        itemsize = self.model.embed_tokens.weight.element_size()
        kv = request_kv_bytes(cfg, itemsize, len(req.input_ids), sp.width, sp.max_new_tokens)
        k = req.top_logprobs_num if req.return_logprob else 0
        kv += top_logprobs_bytes(sp.width, sp.max_new_tokens, k)
        if req.return_sampling_mask and sp.is_stochastic:  # T = 0: the token itself, no table
            cap = self.config.sampling_mask_max_tokens
            kv += sampling_mask_bytes(sp.width, sp.max_new_tokens, cfg.vocab_size, cap)
        return kv + prompt_logprobs.bytes_of(req, cfg.vocab_size, cfg.hidden_size)

    def prefill_tokens_of(self, seq: Sequence) -> int:
        """The tokens admitting it would compute now (the scheduler holds the gate): the prompt's
        not in the prefix cache; a retracted request's kept KV none, a recomputed one's also
        each beam's tokens but the last."""
        if seq.is_started and seq.holds_kv:
            return 0
        tail = (seq.beams.num_steps - 1) * seq.num_beams if seq.needs_recompute else 0
        if not self.executor.is_cacheable(seq):
            return seq.num_prompt_tokens + tail
        tag = weights_tag(self.gate.label, self.gate.generation)
        limit = prompt_logprobs.cache_limit(seq.req)
        return seq.num_prompt_tokens - self.cache.peek(seq.prompt_key, tag, limit) + tail

    def poll(self, request_id: str) -> GenerateResult | None:
        with self.gate:
            result = self.results.peek(request_id)
            if result is None and not self._known(request_id):
                raise self._not_found(request_id)
            return result

    def result(self, request_id: str, timeout: float | None = None) -> GenerateResult:
        with self.gate:
            self.gate.wait_for(
                lambda: self.results.is_ready(request_id) or not self._known(request_id), timeout
            )
            result = self.results.pop(request_id)
            if result is not None:
                return result
            if self._known(request_id):
                raise GenerateTimeout(f"request {request_id!r} did not finish in {timeout}s")
            raise self._not_found(request_id)

    def _not_found(self, request_id: str) -> NotFound:
        if self.results.was_evicted(request_id):
            return NotFound(
                f"the result of {request_id!r} was dropped unfetched: the store was over "
                f"--max-finished-results ({self.config.max_finished_results}) or "
                f"--max-finished-result-bytes ({self.config.max_finished_result_bytes})",
                hint="fetch results sooner, or raise those bounds",
            )
        return NotFound(f"no request {request_id!r}", hint="results are kept until fetched")

    def is_known(self, request_id: str) -> bool:
        """Its id is taken: in flight, or ended with its result kept or being built."""
        with self.gate:
            return self._known(request_id)

    def _known(self, request_id: str) -> bool:
        """In flight, or ended with its result kept or being built (holding the gate)."""
        return request_id in self.scheduler or request_id in self.results

    def generate(self, req: GenerateRequest, timeout: float | None = None) -> GenerateResult:
        """submit + result; on timeout the request is cancelled and its result dropped."""
        return self.generate_many([req], timeout)[0]

    def generate_many(
        self,
        reqs: list[GenerateRequest],
        timeout: float | None = None,
        on_queued: Callable[[list[str]], None] | None = None,
    ) -> list[GenerateResult]:
        """Submit every request (all or none), then wait for each: one scheduler batch. On a
        timeout (for the whole batch) or any error, the unfinished ones are cancelled.
        `on_queued` is called with their ids once all are queued, before the wait."""
        self.check_batch_fits(len(reqs))
        rids: list[str] = []
        results: list[GenerateResult] = []
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            for req in reqs:
                rids.append(self.submit(req))
            if on_queued is not None:
                on_queued(list(rids))
            for rid in rids:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                results.append(self.result(rid, left))
        except BaseException:
            self.discard(rids[len(results) :])
            raise
        return results

    def check_batch_fits(self, num_requests: int) -> None:
        """A batch queued whole can never fit a waiting queue shorter than it: a 400 naming the
        limit, not the retryable 429 of a queue that is only full for now."""
        limit = self.config.max_waiting_requests
        if num_requests > limit:
            raise ValidationError(
                f"a batch of {num_requests} prompts is more than the waiting queue holds "
                f"({limit}, --max-waiting-requests)",
                hint="split the batch, or raise --max-waiting-requests",
            )

    def discard(self, request_ids: list[str]) -> None:
        """Cancel requests and drop their results, as if they had never been submitted."""
        with self.gate:
            for rid in request_ids:
                self.cancel(rid)
            self.gate.wait_for(
                lambda: (
                    not any(r in self.scheduler or self.results.is_pending(r) for r in request_ids)
                ),
                5.0,
            )
            for rid in request_ids:
                self.results.pop(rid)

    def cancel(self, request_id: str) -> bool:
        with self.gate:
            seq = self.scheduler.get(request_id)
            if seq is None:
                return False
            self.worker.abort(seq)
            return True

    def abort_all(self) -> int:
        with self.gate:
            return self.worker.abort_all()

    def num_in_flight(self) -> int:
        with self.gate:
            return self.scheduler.num_in_flight

    # ---- pause, weights, cache ----------------------------------------------------------
    def pause(self, mode: str = "abort") -> int:
        """Stop computing. abort: end every in-flight request (returns how many); retract:
        queue running requests again, keeping their tokens (and their KV until a weight write:
        then they are recomputed); in_place: freeze them with their KV."""
        if mode not in PAUSE_MODES:
            raise ValidationError(f"pause mode must be one of {', '.join(PAUSE_MODES)}")
        with self.gate:
            self.gate.pause(mode, self.config.pause_timeout_s)
            if mode == "abort":
                return self.worker.abort_all()
            if mode == "retract":
                self.scheduler.retract_running()
            return 0

    def resume(self) -> None:
        """Leave the pause; refused (409, still paused) while the weights are mixed or torn."""
        self.gate.resume()

    def require_weights(self, what: str) -> None:
        """MemoryReleased (503) while /release_memory_occupation holds the weights on the host
        (decided for good by whoever holds `weight_ops`)."""
        with self.gate:
            if "weights" in self.gate.released:
                raise self.gate.memory_error(what)

    @contextmanager
    def exclusive(self, abort_all_requests: bool = False) -> Iterator[int]:
        """No model step runs inside (submits still queue). Yields the number aborted."""
        with self.gate:
            if self.scheduler.num_in_flight and not self.gate.is_paused and not abort_all_requests:
                raise Conflict(
                    "requests are in flight",
                    hint="call /pause_generation first (mode=abort) "
                    "or pass abort_all_requests=true",
                )
            self.require_weights("the weights cannot be written")
            self.gate.enter_exclusive()
            num_aborted = self.worker.abort_all() if abort_all_requests else 0
        try:
            yield num_aborted
        finally:
            self.gate.leave_exclusive()

    def weights_written(
        self,
        label: str | None,
        mix: str | None,
        torn: str | None = None,
        discarded: str | None = None,
    ) -> None:
        """The weights side wrote the weights, inside `exclusive()`. From now on steps record
        `label` (None: keep the current one); `mix` describes the weights' labels while they
        differ (None: one label); `torn` the tensors a failed copy left torn (None: none),
        `discarded` those a memory release left without their bytes (None: none). The
        prefix cache's entries go at once, with their bytes: none was computed with these
        weights."""
        with self.gate:
            self.gate.weights_written(label, mix, torn, discarded)
            self.cache.drop_entries()
            self.scheduler.drop_stale_kv()  # retracted requests: recomputed when they run

    def relabel(self, label: str, mix: str | None, abort_all_requests: bool = False) -> int:
        """The weights side relabelled the weights (no write; torn tensors stay torn). Running
        requests go on and report both labels, unless `abort_all_requests`. Returns the number
        aborted."""
        with self.gate:
            num_aborted = self.worker.abort_all() if abort_all_requests else 0
            self.gate.relabel(label, mix)
            return num_aborted

    def flush_cache(self, timeout: float = 0.0) -> tuple[bool, int]:
        """Clear the prefix cache if no request holds KV or is computing (waits up to timeout)."""
        with self.gate:
            idle = self.gate.wait_for(
                lambda: not self.gate.is_computing and not self.scheduler.running, timeout
            )
            return (True, self.cache.clear()) if idle else (False, 0)

    # ---- memory (verl's colocated rollout) ----------------------------------------------
    def release_memory(self, tags: list[str] | None = None) -> list[str]:
        """Free device memory by tag (memory.py); generation is refused until all are back."""
        return self.memory.release(tags, is_busy=lambda: self.scheduler.num_in_flight > 0)

    def resume_memory(self, tags: list[str] | None = None) -> list[str]:
        return self.memory.resume(tags)

    # ---- introspection ------------------------------------------------------------------
    def ready_reasons(self) -> list[str]:
        with self.gate:
            reasons = [reason for reason, _ in self.gate.refusals()]
            if not self.gate.worker_started:  # a died worker is among the refusals
                reasons.append("worker_not_running")
            if len(self.scheduler.waiting) >= self.config.max_waiting_requests:
                reasons.append("waiting_queue_full")
            return reasons

    def status(self) -> dict:
        """/status, less "weights" and "catalog" (their owners report them)."""
        return status.snapshot(self)
