"""The trainer side of the distributed transport: rank 0 of a group with N grctl servers.

    with WeightBroadcaster(["http://a:8000", "http://b:8000"], master_address="10.0.0.5") as wb:
        wb.send(model.state_dict().items(), weight_version=7)

Server i joins as rank 1 + i of world_size 1 + N (grctl serves on one rank). Each server receives
inside its HTTP call, so the call is in flight, in a thread, while rank 0 broadcasts. A refused or
failed call anywhere leaves the servers' collective sequences out of step with ours (a later
broadcast could land in the wrong receive), so the group is then broken: destroy it and init a
new one before sending again.
"""

from __future__ import annotations

import secrets
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait

import torch
import torch.distributed as dist

from grctl.client.http import ClientTimeout, GRClient
from grctl.errors import GrctlError, ValidationError
from grctl.weights.process_group import DEFAULT_TIMEOUT_S, create_group

DEFAULT_BUCKET_BYTES = 512 << 20
NamedTensors = Iterable[tuple[str, torch.Tensor]]
# Broken groups whose lost broadcast is still pending. torch's destroy blocks until it times out
# (and, tried in a daemon thread, stalled the caller too), so each waits here to be destroyed later.
_GRAVEYARD: list[tuple[str, dist.ProcessGroup, list[dist.Work]]] = []


def reap(name: str | None = None, timeout: float = 0.0) -> None:
    """Destroy every broken group whose broadcast has ended; wait up to `timeout` for `name`."""
    deadline = time.monotonic() + timeout
    for entry in list(_GRAVEYARD):
        group_name, pg, works = entry
        while group_name == name and not is_done(works) and time.monotonic() < deadline:
            time.sleep(0.05)
        if is_done(works):
            _GRAVEYARD.remove(entry)
            dist.destroy_process_group(pg)


def is_done(works: list[dist.Work]) -> bool:
    return all(w.is_completed() for w in works)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def buckets(named_tensors: NamedTensors, bucket_bytes: int) -> Iterator[tuple[list, bool]]:
    """Runs of at most `bucket_bytes` (or one larger tensor), each with an is_last flag."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket, False  # not the last: this tensor starts the next one
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket, True


class WeightBroadcaster:
    def __init__(
        self,
        urls: Sequence[str],
        *,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        group_name: str | None = None,
        backend: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        load_format: str | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        api_key: str | None = None,
    ):
        """master_address must be this machine's address as the servers reach it. group_name
        None picks a fresh name per group, so a broken group still timing out never blocks the
        next one (a fixed name, such as SGLang's "weight_update_group", waits for it).

        load_format None (SGLang's default) broadcasts each tensor; "flattened_bucket" one uint8
        tensor per bucket, which costs a copy of the bucket here (5x slower over gloo on the CPU)
        and saves per-collective overhead where that dominates (many small tensors on NCCL).
        """
        self.clients = [GRClient(u, api_key=api_key, update_timeout=timeout_s + 60) for u in urls]
        self.master_address, self.master_port = master_address, master_port
        self.group_name, self.timeout_s = group_name, timeout_s
        self.name = group_name  # this group's name once init_group() picks it
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.device = torch.device("cuda" if self.backend == "nccl" else "cpu")
        self.load_format, self.bucket_bytes = load_format, bucket_bytes
        self.pg: dist.ProcessGroup | None = None
        self.is_broken = False
        self._works: list[dist.Work] = []  # the last bucket's broadcasts
        self._pool = ThreadPoolExecutor(len(self.clients) + 1, thread_name_prefix="grctl-bcast")

    def init_group(self) -> None:
        """Every server's blocking init call at once, then join as rank 0 beside them."""
        self.name = self.group_name or f"grctl-{secrets.token_hex(4)}"
        reap(self.name, self.timeout_s + 10)
        port = self.master_port or free_port()
        world, addr = 1 + len(self.clients), self.master_address
        calls = [
            self._pool.submit(
                c.init_weights_update_group, addr, port, 1 + i, world, self.name, self.backend
            )
            for i, c in enumerate(self.clients)
        ]
        join = self._pool.submit(
            create_group, self.backend, addr, port, world, 0, self.name, self.timeout_s
        )
        self._wait(calls, join.done)
        self.pg, self.is_broken = join.result(), False

    def send(
        self,
        named_tensors: NamedTensors,
        *,
        weight_version: str | int | None = None,
        flush_cache: bool = True,
    ) -> dict:
        """Broadcast HF-named tensors in buckets, one update call per bucket on every server.
        Every call carries weight_version (each bucket's tensors take that label, as slime
        sends it; a label on the last call alone would leave the rest under the old one, a
        mix the server refuses to serve); only the last flushes the cache. Returns counts and
        seconds."""
        if self.pg is None or self.is_broken:
            raise ValidationError(
                f"weight update group {self.name!r} is not usable",
                hint="call init_group() (after destroy() if a send failed)",
            )
        t0, num_tensors, num_bytes, num_buckets = time.perf_counter(), 0, 0, 0
        for bucket, is_last in buckets(named_tensors, self.bucket_bytes):
            tensors = [t.detach().to(self.device).contiguous() for _, t in bucket]
            self._send_bucket(
                [n for n, _ in bucket],
                tensors,
                weight_version,
                flush_cache and is_last,
            )
            num_tensors += len(tensors)
            num_bytes += sum(t.numel() * t.element_size() for t in tensors)
            num_buckets += 1
        seconds = time.perf_counter() - t0
        return {"tensors": num_tensors, "bytes": num_bytes, "buckets": num_buckets, "s": seconds}

    def _send_bucket(self, names, tensors, weight_version, flush_cache) -> None:
        calls = [
            self._pool.submit(
                c.update_weights_from_distributed,
                names,
                [str(t.dtype) for t in tensors],
                [list(t.shape) for t in tensors],
                group_name=self.name,
                load_format=self.load_format,
                weight_version=weight_version,
                flush_cache=flush_cache,
            )
            for c in self.clients
        ]
        if self.load_format == "flattened_bucket":
            # grctl's FlattenedTensorBucket layout: each tensor's bytes in order, no padding.
            tensors = [torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])]
        self._works = works = [dist.broadcast(t, 0, group=self.pg, async_op=True) for t in tensors]
        self._wait(calls, lambda: is_done(works))
        for w in works:
            w.wait()  # raises the broadcast's own error, if it had one

    def _wait(self, calls: list[Future], is_local_done: Callable[[], bool]) -> None:
        """Until every call answered and our side is done; the first failed call raises now."""
        deadline = time.monotonic() + self.timeout_s + 60
        try:
            while True:
                done, _ = wait(calls, timeout=0.002, return_when=FIRST_EXCEPTION)
                for f in done:
                    if f.exception() is not None:
                        raise f.exception()
                if len(done) == len(calls) and is_local_done():
                    return
                if time.monotonic() > deadline:
                    raise ClientTimeout(f"group {self.name!r}: no progress in time")
        except BaseException:
            self.is_broken = True
            raise

    def destroy(self) -> None:
        """Destroy the group on every server (one that already dropped it is fine), then here."""
        if self.name is None:
            return
        calls = [self._pool.submit(c.destroy_weights_update_group, self.name) for c in self.clients]
        errors = [f.exception() for f in calls]
        pg, self.pg = self.pg, None
        if pg is not None and not is_done(self._works):
            _GRAVEYARD.append((self.name, pg, self._works))
        elif pg is not None:
            dist.destroy_process_group(pg)
        failed = [e for e in errors if e is not None and not isinstance(e, ValidationError)]
        if failed:
            raise failed[0]

    def close(self) -> None:
        if self.pg is not None:
            try:
                self.destroy()
            except GrctlError:
                pass
        self._pool.shutdown(wait=False, cancel_futures=True)
        for c in self.clients:
            c.close()

    def __enter__(self) -> WeightBroadcaster:
        try:
            self.init_group()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
