"""WeightSync: pause -> flush (retry) -> push -> continue -> verify, on one server or a fleet.

    result = WeightSync(["http://a:8000", "http://b:8000"]).run("/ckpt/step_7", weight_version=7)
    result = WeightSync(router="http://gw:30000").run(...)  # the workers behind sglang-router
    result = sync.run(model.state_dict(), weight_version="step-7")  # tensors a trainer holds
    result = sync.run("/ckpt/step_7", weight_version=7, catalog_path="/ckpt/step_7/items.jsonl")

Every stage runs on all servers at once. Before anything is paused, a tensor push checks that
the checkpoint (or the tensors) covers each server's model (the sink's own plan, against the
served parameters' shapes), so a partial source is refused with every server untouched. A
server that fails is dropped from the later stages but is still resumed, unless it took some
but not all of the tensor chunks: its weights are then partly new, so it is left paused, and
the server itself refuses to resume while its tensors carry mixed labels. The servers that did
not fail go on to the end. If any server failed, SyncError is raised naming every server's
outcome; its `result` is the same SyncResult a clean run returns. Ctrl-C (KeyboardInterrupt)
stops the sync the same way: partial servers stay paused, the others are resumed, and
SyncInterrupted carries the result.

With `catalog_path` (a catalog JSONL each server reads) the catalog goes with the weights: the
disk update (a server's own read, auto included) carries it; a staged push runs inside a weight
update session that carries it, so each server builds it before the first chunk and installs it
with the last (nothing is served in between). A server whose catalog does not load fails before
any weight is written.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec

from grctl.client import devices, hosts, sources, staging
from grctl.client.http import DEFAULT_URL, GRClient
from grctl.client.outcome import (
    TRANSPORTS,
    Progress,
    ServerOutcome,
    SyncError,
    SyncInterrupted,
    SyncResult,
    stopped_by,
)
from grctl.client.pipeline import PushOptions, Target, is_refusal, push_buckets
from grctl.client.preflight import check_covers
from grctl.client.router import worker_urls as router_workers
from grctl.client.verify import compare_servers, dtype_of, read_server
from grctl.errors import GrctlError, ValidationError
from grctl.protocol.weights import version_str
from grctl.weights.checkpoint import Checkpoint
from grctl.weights.wire import encode


class WeightSync:
    def __init__(
        self,
        urls: str | Sequence[str] | None = None,
        *,
        router: str | None = None,
        transport: str = "auto",
        bucket_mb: float | None = None,
        chunked: bool | None = None,
        pause_mode: str = "abort",
        verify: bool = False,
        flush_retries: int = 60,
        flush_interval: float = 1.0,
        stage_device: str | None = None,
        on_progress: Callable[[Progress], None] | None = None,
        **client_kw,
    ):
        """`urls`: the servers (default DEFAULT_URL unless `router` is given); `router`: an
        sglang-router whose workers are synced too. `client_kw` goes to each GRClient
        (api_key, bearer, timeout, update_timeout).

        `transport`: "auto" (the default) sends a checkpoint path to the servers on this host,
        which read it themselves (one copy; any that refuses the path gets staged buckets
        instead) and stages buckets for the others and for tensors in memory; "tensor" always
        stages; "disk" always sends the path. Giving `bucket_mb` or `chunked` asks for staged
        buckets: with "auto" it means "tensor". `bucket_mb` defaults to 512."""
        if transport not in (*TRANSPORTS, "auto"):
            raise ValidationError(f"transport must be auto, tensor or disk, not {transport!r}")
        if transport == "auto" and (bucket_mb is not None or chunked is not None):
            transport = "tensor"
        bucket_mb, chunked = 512 if bucket_mb is None else bucket_mb, chunked is not False
        if bucket_mb <= 0:
            raise ValidationError("bucket_mb must be > 0")
        self.urls = [urls] if isinstance(urls, str) else list(urls or [])
        if router is not None:
            self.urls += router_workers(router)
        elif not self.urls:
            self.urls = [DEFAULT_URL]
        if not self.urls:
            raise ValidationError("no server URL given")
        self.transport, self.pause_mode, self.verify = transport, pause_mode, verify
        self.bucket_bytes = int(bucket_mb * staging.MiB) if chunked else 1 << 62
        self.flush_retries, self.flush_interval = flush_retries, flush_interval
        self.stage_device, self.on_progress = stage_device, on_progress
        self.clients = {url: GRClient(url, **client_kw) for url in dict.fromkeys(self.urls)}
        self._pool = ThreadPoolExecutor(max_workers=max(2, len(self.clients)))
        self._covered: set[tuple] = set()  # (url, server, source) already planned: see _plan
        self._infos: dict[str, object] = {}  # url -> the last /server_info

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for client in self.clients.values():
            client.close()

    def __enter__(self) -> WeightSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _stage(self, result: SyncResult, name: str, fn: Callable[[ServerOutcome], None]) -> None:
        """Run `fn` on every server still ok, all at once; a raise fails that server."""
        t0 = time.perf_counter()

        def one(out: ServerOutcome) -> None:
            t1 = time.perf_counter()
            try:
                fn(out)
            except Exception as exc:
                out.fail(name, exc)
            out.timings[name] = round(time.perf_counter() - t1, 4)

        list(self._pool.map(one, [o for o in result.servers if o.ok]))
        result.timings[name] = round(time.perf_counter() - t0, 4)

    def run(
        self,
        source,
        *,
        weight_version: str | int | None = None,
        token_step: int | str | None = None,
        catalog_path: str | Path | None = None,
    ) -> SyncResult:
        """Sync `source` to every server: a checkpoint directory, or (tensor transport) the
        tensors a trainer holds: a state dict or (hf_name, tensor) pairs, CPU or CUDA, held by
        reference until this returns. `catalog_path`: the catalog of these weights, installed
        with them. Raises SyncError (or SyncInterrupted) naming what each server was left
        with."""
        t0 = time.perf_counter()
        if self.transport == "disk" and not sources.is_path(source):
            raise ValidationError(
                "the disk transport sends a checkpoint path; push tensors in memory with "
                "transport='tensor'"
            )
        # A tensor push opens its source once, before any server is touched.
        src = sources.open_source(source) if self.transport != "disk" else None
        try:
            if src is not None:
                src.specs()  # an unreadable checkpoint fails before any server pauses
            version = version_str(weight_version)
            label = sources.label_of(source, src)
            transport = "tensor" if self.transport == "auto" else self.transport
            result = SyncResult(version, transport, label, [ServerOutcome(u) for u in self.clients])
            try:
                self._stage(result, "connect", self._connect)
                if src is not None:
                    self._stage(result, "plan", lambda o: self._plan(o, src))
                    self._start_shm_manager(result, source)
                catalog = None if catalog_path is None else server_path(catalog_path)
                self._update(result, src or source, version, token_step, catalog)
                self._verify(result, src or source, version)
            except KeyboardInterrupt as exc:  # before the pause or after the resume
                if isinstance(exc, SyncInterrupted):
                    raise
                result.interrupted_by = stopped_by(exc)
                raise SyncInterrupted(result) from exc
        finally:
            if src is not None and src is not source:  # a caller's own source stays open
                src.close()
        result.timings["total"] = round(time.perf_counter() - t0, 4)
        if not result.ok:
            raise SyncError(result)
        return result

    def _update(self, result: SyncResult, source, version, token_step, catalog=None) -> None:
        """pause -> flush -> push -> continue. Whatever stops it, a partial server (some but
        not all of its chunks applied) is never resumed; Ctrl-C raises SyncInterrupted."""
        planned = [o for o in result.servers if o.ok]
        try:
            self._stage(result, "pause", self._pause)
            if self.pause_mode != "in_place":  # in_place keeps KV by design (miles skips it)
                self._stage(
                    result,
                    "flush",
                    lambda o: self.clients[o.url].flush_cache_until_ok(
                        self.flush_retries, self.flush_interval
                    ),
                )
            self._push(result, source, version, token_step, catalog)
        except BaseException as exc:
            for out in planned:
                if out.ok:
                    out.fail("push" if out.num_buckets else "pause", f"stopped: {exc!r}")
            self._finish(result, planned)
            if isinstance(exc, KeyboardInterrupt):
                result.interrupted_by = stopped_by(exc)
                raise SyncInterrupted(result) from exc
            raise
        self._finish(result, planned)

    def _pause(self, out: ServerOutcome) -> None:
        out.paused = True  # set first: an interrupted call may still have paused it
        self.clients[out.url].pause_generation(self.pause_mode)

    def _finish(self, result: SyncResult, planned: list[ServerOutcome]) -> None:
        """Resume what this sync paused, except partial servers: read their labels instead."""
        self._resume(result, [o for o in planned if o.paused and not o.is_partial])

        def labels(out: ServerOutcome) -> None:
            try:
                out.label_counts = self.clients[out.url].get_weight_version().label_counts
            except Exception:  # the server may be gone: the state report says what it can
                out.label_counts = None

        list(self._pool.map(labels, [o for o in planned if o.is_partial]))

    def _connect(self, out: ServerOutcome) -> None:
        info = self.clients[out.url].server_info()
        out.old_version = out.weight_version = info.weight_version
        out.device, out.dtype, out.gpu_uuid = info.device, info.dtype, info.gpu_uuid
        self._infos[out.url] = info

    def _plan(self, out: ServerOutcome, src) -> None:
        """check_covers once per (server, source structure): the server's /server_info (bar
        its version label) names its model, a source's names, shapes, dtypes and config its
        structure. A restarted or reconfigured server answers differently and is planned again."""
        info = self._infos.get(out.url)
        served = msgspec.structs.replace(info, weight_version="") if info is not None else None
        key = (out.url, msgspec.json.encode(served), tuple(src.specs()), repr(src.config))
        if key in self._covered:
            return
        check_covers(self.clients[out.url], src)
        self._covered.add(key)

    def _start_shm_manager(self, result: SyncResult, source) -> None:
        """torch_shm_manager (0.2-0.3 s to start: it links libtorch) starts before the pause,
        not inside the paused window, when some server will read shared memory from here."""
        stages = [o for o in result.servers if o.ok and (o.device or "cpu") == "cpu"]
        if stages and not (self.transport == "auto" and self._reads_itself(source)):
            encode.start_shm_manager_detached()

    def _reads_itself(self, source) -> bool:
        """A path source for servers on this host: they read the checkpoint themselves."""
        return sources.is_path(source) and all(hosts.is_local(u) for u in self.clients)

    def _push(self, result: SyncResult, source, version, token_step, catalog=None) -> None:
        """`source`: the checkpoint path (disk), or the open source (tensor, auto). auto: a
        checkpoint goes to servers on this host by their own read of it (one copy, page cache
        -> parameters, whole or not at all), the rest, and any that refuses the read, by
        staged buckets. `catalog`: the catalog path each server reads, installed with the
        weights (a staged push carries it in a weight update session)."""
        t0 = time.perf_counter()
        todo = [o for o in result.servers if o.ok]
        if self.transport == "disk":
            self._push_disk(result, str(source), todo, version, token_step, catalog=catalog)
        else:
            if self.transport == "auto" and isinstance(source, Checkpoint):
                local = [o for o in todo if hosts.is_local(o.url)]
                read = self._push_disk(result, str(source.path), local, version, token_step,
                                       fallback=True, catalog=catalog)  # fmt: skip
                todo = [o for o in todo if o not in read]
                if read and not todo:
                    result.transport = "disk"
            if todo and catalog is None:
                self._push_tensors(result, source, PushOptions(version, token_step), todo)
            elif todo:
                self._push_in_session(
                    result, source, PushOptions(version, token_step), todo, catalog
                )
        result.timings["push"] = round(time.perf_counter() - t0, 4)
        for out in result.servers:
            out.timings.setdefault("push", result.timings["push"])  # tensor chunks go to all

    def _push_disk(
        self,
        result,
        checkpoint: str,
        outs,
        version,
        token_step,
        fallback: bool = False,
        catalog: str | None = None,
    ) -> list[ServerOutcome]:
        """update_weights_from_disk on `outs`; returns those that read it. `fallback`: a server
        that refuses it (a 4xx: nothing changed, e.g. the path is not there for it) is left
        ok, for the staged push."""
        local = Path(checkpoint)
        path = str(local.resolve()) if local.exists() else str(checkpoint)

        def disk(out: ServerOutcome) -> bool:
            try:
                reply = self.clients[out.url].update_weights_from_disk(
                    path, weight_version=version, token_step=token_step, catalog_path=catalog
                )
            except Exception as exc:
                if not (fallback and is_refusal(exc)):
                    out.fail("push", exc)
                return False
            out.num_tensors = reply.tensors_loaded
            return True

        return [o for o, ok in zip(outs, self._pool.map(disk, outs), strict=True) if ok]

    def _push_in_session(self, result: SyncResult, src, opts: PushOptions, outs, catalog: str):
        """The chunks inside a weight update session that carries the catalog: each server
        builds it at the begin (one that cannot fails there, before any chunk) and installs it
        at the end. A server that opened the session but did not take every chunk still ends
        it: it then refuses to serve, saying why."""

        def call(name: str, fn: Callable[[ServerOutcome], None], on: list) -> list:
            def one(out: ServerOutcome) -> bool:
                try:
                    fn(out)
                    return True
                except Exception as exc:
                    if out.ok:
                        out.fail(name, exc)
                    return False

            return [o for o, ok in zip(on, self._pool.map(one, on), strict=True) if ok]

        begun = call(
            "begin", lambda o: self.clients[o.url].begin_weight_update(catalog_path=catalog), outs
        )
        try:
            self._push_tensors(result, src, opts, begun)
        finally:
            call("end", lambda o: self.clients[o.url].end_weight_update(), begun)

    def _push_tensors(self, result: SyncResult, src, opts: PushOptions, outs) -> None:
        """One staging per (local device, served dtype): servers on the same GPU read the same
        buckets; servers on other GPUs of this machine get their own, staged on their GPU."""
        groups: dict[tuple, list[ServerOutcome]] = {}
        for out in outs:
            try:
                device = devices.stage_device(out.device, self.stage_device, out.gpu_uuid)
            except GrctlError as exc:
                out.fail("push", exc)
                continue
            groups.setdefault((device, dtype_of(out.dtype)), []).append(out)
        plans = {k: sources.plans_of(src, k[1], self.bucket_bytes, k[0]) for k in groups}
        result.num_buckets = sum(len(p) for p in plans.values())
        result.num_bytes = sum(b.nbytes for p in plans.values() for b in p)
        progress = self._progress_reporter(result)
        for key, outs in groups.items():
            targets = [Target(self.clients[o.url], o) for o in outs]
            try:
                push_buckets(src, plans[key], key[0], targets, self._pool, opts, progress)
            except Exception as exc:  # staging failed: the group's servers stop here
                for out in outs:
                    out.fail("push", exc)

    def _progress_reporter(self, result: SyncResult) -> Callable[[staging.BucketPlan], None]:
        done = Progress(0, result.num_buckets, 0, result.num_bytes, 0.0)
        t0 = time.perf_counter()

        def on_bucket(plan: staging.BucketPlan) -> None:
            done.buckets_done += 1
            done.bytes_done += plan.nbytes
            done.seconds = time.perf_counter() - t0
            if self.on_progress:
                self.on_progress(done)

        return on_bucket

    def _resume(self, result: SyncResult, reached: list[ServerOutcome]) -> None:
        def resume(out: ServerOutcome) -> None:
            t1 = time.perf_counter()
            try:
                self.clients[out.url].continue_generation()
                out.resumed = True
            except Exception as exc:
                out.fail("continue", exc)
            out.timings["continue"] = round(time.perf_counter() - t1, 4)

        t0 = time.perf_counter()
        list(self._pool.map(resume, reached))
        result.timings["continue"] = round(time.perf_counter() - t0, 4)

    def _verify(self, result: SyncResult, source, version: str | None) -> None:
        """The version every server reports now; with verify, every tensor's sha256 against
        the source's (a checkpoint path, or the open source of a tensor push)."""

        def read(out: ServerOutcome):
            t1 = time.perf_counter()
            try:
                return read_server(self.clients[out.url], out, version, self.verify)
            finally:
                out.timings["verify"] = round(time.perf_counter() - t1, 4)

        t0 = time.perf_counter()
        reached = [o for o in result.servers if o.failed_stage != "connect"]
        replies = zip(reached, self._pool.map(read, reached), strict=True)
        checks = [(o, c) for o, c in replies if c is not None]
        if checks:
            compare_servers(checks, source)
        result.timings["verify"] = round(time.perf_counter() - t0, 4)


def server_path(path: str | Path) -> str:
    """A path the server reads: absolute when it names a file here (a server on this machine),
    else as given (the server's own path)."""
    local = Path(path)
    return str(local.resolve()) if local.exists() else str(path)
