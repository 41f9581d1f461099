"""One method per route of docs/http-api.md, shared by GRClient and AsyncGRClient.

Each method only describes its call (a `Call`: method, path, body, how to read the reply); the
subclass's `_call` sends it. GRClient's methods return the result; AsyncGRClient's return an
awaitable of the same result. Optional body keys left as None are not sent, as slime does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from grctl.client import types as t
from grctl.client.calls import Call, as_, compact, request_body, status_of, text
from grctl.errors import ValidationError
from grctl.model.dtypes import name_of

GROUP = "weight_update_group"


class Routes:
    def _call(self, call: Call) -> Any:
        raise NotImplementedError

    # Serving
    def generate(self, input_ids=None, sampling_params=None, **kw: Any) -> t.GenerateResult:
        body = request_body(input_ids, sampling_params, **kw)
        return self._call(Call("POST", "/generate", as_(t.GenerateResult), body, kind="generate"))

    def generate_batch(
        self, prompts: Sequence[Sequence[int]], sampling_params=None, **kw: Any
    ) -> list[t.GenerateResult]:
        """One /generate for many prompts (SGLang's batch): one reply per prompt, in order.
        `sampling_params` and `rid` may be one for all or a list with one per prompt."""
        per_prompt = isinstance(sampling_params, (list, tuple))
        body = request_body(
            [list(p) for p in prompts], None if per_prompt else sampling_params, **kw
        )
        if per_prompt:
            if body["sampling_params"]:
                raise ValidationError("with one sampling_params per prompt, put options in each")
            body["sampling_params"] = [dict(sp) for sp in sampling_params]
        decode = as_(list[t.GenerateResult])
        return self._call(Call("POST", "/generate", decode, body, kind="generate"))

    def submit(self, input_ids=None, sampling_params=None, **kw: Any) -> t.Submitted:
        body = request_body(input_ids, sampling_params, **kw)
        return self._call(Call("POST", "/submit", as_(t.Submitted), body))

    def submit_many(self, requests: Sequence[dict]) -> t.SubmittedMany:
        body = {"requests": list(requests)}
        return self._call(Call("POST", "/submit_many", as_(t.SubmittedMany), body))

    def poll(self, request_id: str) -> t.PollResult:
        return self._call(Call("GET", f"/poll/{request_id}", as_(t.PollResult)))

    def result(self, request_id: str, wait: float | None = None) -> t.GenerateResult:
        """Wait for a reply: `wait` seconds on the server (None: its --generate-timeout-s)."""
        params = compact(timeout=wait)
        return self._call(
            Call(
                "GET",
                f"/result/{request_id}",
                as_(t.GenerateResult),
                params=params,
                kind="generate",
                extra_timeout=wait or 0.0,
            )
        )

    def cancel(self, request_id: str) -> t.CancelResult:
        body = {"request_id": request_id}
        return self._call(Call("POST", "/cancel", as_(t.CancelResult), body))

    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> t.AbortResult:
        body = {"abort_all": True} if abort_all else compact(rid=rid)
        return self._call(Call("POST", "/abort_request", as_(t.AbortResult), body))

    # Health, discovery, status
    def health(self) -> t.Health:
        return self._call(Call("GET", "/health", as_(t.Health)))

    def ready(self) -> t.Readiness:
        """Readiness as data: a 503 (not ready) is returned, not raised."""
        return self._call(Call("GET", "/ready", as_(t.Readiness), ok_statuses=(503,)))

    def status(self) -> t.Status:
        return self._call(Call("GET", "/status", status_of))

    def metrics(self) -> str:
        return self._call(Call("GET", "/metrics", text))

    def server_info(self) -> t.ServerInfo:
        return self._call(Call("GET", "/server_info", as_(t.ServerInfo)))

    def model_info(self) -> t.ModelInfo:
        return self._call(Call("GET", "/model_info", as_(t.ModelInfo)))

    def health_generate(self) -> t.Health:
        return self._call(Call("GET", "/health_generate", as_(t.Health), kind="generate"))

    def flush_cache(self, wait: float | None = None) -> t.FlushResult:
        """One GET /flush_cache; raises CacheBusy (400) while requests hold KV."""
        params = compact(timeout=wait)
        return self._call(
            Call(
                "GET", "/flush_cache", as_(t.FlushResult), params=params, extra_timeout=wait or 0.0
            )
        )

    # Item catalog
    def catalog_status(self) -> t.CatalogStatus:
        return self._call(Call("GET", "/catalog/status", as_(t.CatalogStatus)))

    def catalog_reload(self, path: str) -> t.CatalogStatus:
        """Build the JSONL catalog at `path` (on the server) and serve it."""
        body = {"path": path}
        return self._call(Call("POST", "/catalog/reload", as_(t.CatalogStatus), body))

    def catalog_rollback(self) -> t.CatalogStatus:
        return self._call(Call("POST", "/catalog/rollback", as_(t.CatalogStatus), {}))

    # Memory (verl's colocated rollout; the server needs --enable-memory-saver)
    def release_memory_occupation(self, tags: Sequence[str] | None = None) -> t.MemoryResult:
        """Free device memory by tag (kv_cache, weights, cuda_graph; None: all)."""
        body = {"tags": list(tags) if tags is not None else None}
        return self._call(Call("POST", "/release_memory_occupation", as_(t.MemoryResult), body))

    def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> t.MemoryResult:
        body = {"tags": list(tags) if tags is not None else None}
        return self._call(Call("POST", "/resume_memory_occupation", as_(t.MemoryResult), body))

    # Weight sync
    def pause_generation(self, mode: str = "abort") -> t.PauseResult:
        return self._call(Call("POST", "/pause_generation", as_(t.PauseResult), {"mode": mode}))

    def continue_generation(self) -> t.ContinueResult:
        return self._call(Call("POST", "/continue_generation", as_(t.ContinueResult), {}))

    def get_weight_version(self) -> t.WeightVersion:
        return self._call(Call("GET", "/get_weight_version", as_(t.WeightVersion)))

    def update_weight_version(
        self, new_version: t.Version, abort_all_requests: bool = False
    ) -> t.VersionUpdate:
        body = {"new_version": t.version_str(new_version), "abort_all_requests": abort_all_requests}
        return self._call(Call("POST", "/update_weight_version", as_(t.VersionUpdate), body))

    def begin_weight_update(self, selector: str = "all") -> t.SuccessResult:
        """Open SGLang 0.5.23's update session (409 conflict if one is open)."""
        body = {"selector": selector}
        return self._call(Call("POST", "/begin_weight_update", as_(t.SuccessResult), body))

    def end_weight_update(self) -> t.SuccessResult:
        """Close it: the label counts; 409 weights_mixed if it leaves the weights mixed."""
        return self._call(Call("POST", "/end_weight_update", as_(t.SuccessResult), {}))

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> t.WeightsByName:
        params = {"name": name, "truncate_size": truncate_size}
        return self._call(Call("GET", "/get_weights_by_name", as_(t.WeightsByName), params=params))

    def weights_checker(self, action: str = "checksum") -> t.CheckerResult:
        """snapshot | reset_tensors | compare | checksum (sha256 of every HF-named tensor)."""
        body = {"action": action}
        return self._call(Call("POST", "/weights_checker", as_(t.CheckerResult), body))

    def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: t.Version = None,
        token_step: int | str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        load_format: str | None = None,
    ) -> t.UpdateResult:
        body = compact(
            model_path=str(model_path),
            weight_version=t.version_str(weight_version),
            token_step=token_step,
            flush_cache=flush_cache,
            abort_all_requests=abort_all_requests,
            load_format=load_format,
        )
        return self._call(
            Call("POST", "/update_weights_from_disk", as_(t.UpdateResult), body, kind="update")
        )

    def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[str],
        *,
        load_format: str | None = "flattened_bucket",
        weight_version: t.Version = None,
        token_step: int | str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> t.UpdateResult:
        """One chunk: one base64 payload per TP rank (grctl has one). Keep the payload's
        tensors alive until this returns: the server reads them during the call."""
        body = compact(
            serialized_named_tensors=list(serialized_named_tensors),
            weight_version=t.version_str(weight_version),
            token_step=token_step,
            flush_cache=flush_cache,
            abort_all_requests=abort_all_requests,
        )
        body["load_format"] = load_format  # always sent, null included (slime does)
        return self._call(
            Call("POST", "/update_weights_from_tensor", as_(t.UpdateResult), body, kind="update")
        )

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = GROUP,
        backend: str | None = None,
    ) -> t.SuccessResult:
        body = compact(
            master_address=master_address,
            master_port=master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        )
        return self._call(
            Call("POST", "/init_weights_update_group", as_(t.SuccessResult), body, kind="update")
        )

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str = GROUP,
        load_format: str | None = None,
        weight_version: t.Version = None,
        token_step: int | str | None = None,
        flush_cache: bool = True,
    ) -> t.SuccessResult:
        body = compact(
            names=list(names),
            dtypes=[name_of(d) for d in dtypes],
            shapes=[list(s) for s in shapes],
            group_name=group_name,
            load_format=load_format,
            weight_version=t.version_str(weight_version),
            token_step=token_step,
            flush_cache=flush_cache,
        )
        return self._call(
            Call(
                "POST",
                "/update_weights_from_distributed",
                as_(t.SuccessResult),
                body,
                kind="update",
            )
        )

    def destroy_weights_update_group(self, group_name: str = GROUP) -> t.SuccessResult:
        body = {"group_name": group_name}
        return self._call(Call("POST", "/destroy_weights_update_group", as_(t.SuccessResult), body))
