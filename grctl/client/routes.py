"""One method per route of docs/http-api.md, shared by GRClient and AsyncGRClient.

Each method only describes its call (a `Call`: method, path, body, how to read the reply); the
subclass's `_call` sends it. GRClient's methods return the result; AsyncGRClient's return an
awaitable of the same result. Optional body keys left as None are not sent, as slime does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from grctl.client.calls import Call, as_, compact, request_body, status_of, text
from grctl.errors import ValidationError
from grctl.model.dtype_names import name_of
from grctl.protocol import catalog, info
from grctl.protocol import generate as gen
from grctl.protocol import weights as w


class Routes:
    def _call(self, call: Call) -> Any:
        raise NotImplementedError

    # Serving
    def generate(self, input_ids=None, sampling_params=None, **kw: Any) -> gen.GenerateResponse:
        body = request_body(input_ids, sampling_params, **kw)
        return self._call(
            Call("POST", "/generate", as_(gen.GenerateResponse), body, kind="generate")
        )

    def generate_batch(
        self, prompts: Sequence[Sequence[int]], sampling_params=None, **kw: Any
    ) -> list[gen.GenerateResponse]:
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
        decode = as_(list[gen.GenerateResponse])
        return self._call(Call("POST", "/generate", decode, body, kind="generate"))

    def submit(self, input_ids=None, sampling_params=None, **kw: Any) -> gen.SubmitResponse:
        body = request_body(input_ids, sampling_params, **kw)
        return self._call(Call("POST", "/submit", as_(gen.SubmitResponse), body))

    def submit_many(self, requests: Sequence[dict]) -> gen.SubmitManyResponse:
        body = {"requests": list(requests)}
        return self._call(Call("POST", "/submit_many", as_(gen.SubmitManyResponse), body))

    def poll(self, request_id: str) -> gen.PollResponse:
        return self._call(Call("GET", f"/poll/{request_id}", as_(gen.PollResponse)))

    def result(self, request_id: str, wait: float | None = None) -> gen.GenerateResponse:
        """Wait for a reply: `wait` seconds on the server (None: its --generate-timeout-s)."""
        params = compact(timeout=wait)
        return self._call(
            Call(
                "GET",
                f"/result/{request_id}",
                as_(gen.GenerateResponse),
                params=params,
                kind="generate",
                extra_timeout=wait or 0.0,
            )
        )

    def cancel(self, request_id: str) -> gen.CancelResponse:
        body = {"request_id": request_id}
        return self._call(Call("POST", "/cancel", as_(gen.CancelResponse), body))

    def abort_request(
        self, rid: str | None = None, abort_all: bool = False
    ) -> gen.AbortRequestResponse:
        body = {"abort_all": True} if abort_all else compact(rid=rid)
        return self._call(Call("POST", "/abort_request", as_(gen.AbortRequestResponse), body))

    # Health, discovery, status
    def health(self) -> info.HealthResponse:
        return self._call(Call("GET", "/health", as_(info.HealthResponse)))

    def ready(self) -> info.ReadyResponse:
        """Readiness as data: a 503 (not ready) is returned, not raised."""
        return self._call(Call("GET", "/ready", as_(info.ReadyResponse), ok_statuses=(503,)))

    def status(self) -> info.ServerStatus:
        return self._call(Call("GET", "/status", status_of))

    def metrics(self) -> str:
        return self._call(Call("GET", "/metrics", text))

    def server_info(self) -> info.ServerInfo:
        return self._call(Call("GET", "/server_info", as_(info.ServerInfo)))

    def model_info(self) -> info.ModelInfo:
        return self._call(Call("GET", "/model_info", as_(info.ModelInfo)))

    def health_generate(self) -> info.HealthResponse:
        return self._call(
            Call("GET", "/health_generate", as_(info.HealthResponse), kind="generate")
        )

    def flush_cache(self, wait: float | None = None) -> info.FlushCacheResponse:
        """One GET /flush_cache; raises CacheBusy (400) while requests hold KV."""
        params = compact(timeout=wait)
        return self._call(
            Call(
                "GET",
                "/flush_cache",
                as_(info.FlushCacheResponse),
                params=params,
                extra_timeout=wait or 0.0,
            )
        )

    # Item catalog
    def catalog_status(self) -> catalog.CatalogStatus:
        return self._call(Call("GET", "/catalog/status", as_(catalog.CatalogStatus)))

    def catalog_reload(self, path: str) -> catalog.CatalogStatus:
        """Build the JSONL catalog at `path` (on the server) and serve it."""
        body = {"path": path}
        return self._call(Call("POST", "/catalog/reload", as_(catalog.CatalogStatus), body))

    def catalog_rollback(self, force: bool = False) -> catalog.CatalogStatus:
        """force: even to a catalog installed with other weights than the served ones."""
        body = {"force": True} if force else {}
        return self._call(Call("POST", "/catalog/rollback", as_(catalog.CatalogStatus), body))

    # Memory (verl's colocated rollout; the server needs --enable-memory-saver)
    def release_memory_occupation(self, tags: Sequence[str] | None = None) -> w.MemoryResponse:
        """Free device memory by tag (kv_cache, weights, cuda_graph; None: all)."""
        body = {"tags": list(tags) if tags is not None else None}
        return self._call(Call("POST", "/release_memory_occupation", as_(w.MemoryResponse), body))

    def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> w.MemoryResponse:
        body = {"tags": list(tags) if tags is not None else None}
        return self._call(Call("POST", "/resume_memory_occupation", as_(w.MemoryResponse), body))

    # Weight sync
    def pause_generation(self, mode: str = "abort") -> w.PauseResponse:
        return self._call(Call("POST", "/pause_generation", as_(w.PauseResponse), {"mode": mode}))

    def continue_generation(self) -> w.ContinueResponse:
        return self._call(Call("POST", "/continue_generation", as_(w.ContinueResponse), {}))

    def get_weight_version(self) -> w.WeightVersionResponse:
        return self._call(Call("GET", "/get_weight_version", as_(w.WeightVersionResponse)))

    def update_weight_version(
        self, new_version: w.Version, abort_all_requests: bool = False
    ) -> w.UpdateWeightVersionResponse:
        body = {"new_version": w.version_str(new_version), "abort_all_requests": abort_all_requests}
        return self._call(
            Call("POST", "/update_weight_version", as_(w.UpdateWeightVersionResponse), body)
        )

    def begin_weight_update(
        self, selector: str = "all", *, catalog_path: str | None = None
    ) -> w.SuccessResponse:
        """Open SGLang 0.5.23's update session (409 conflict if one is open). `catalog_path`:
        the catalog (a JSONL on the server) of the weights the session writes, built now and
        installed by /end_weight_update; nothing is served in between."""
        body = compact(selector=selector, catalog_path=catalog_path)
        return self._call(Call("POST", "/begin_weight_update", as_(w.SuccessResponse), body))

    def end_weight_update(self) -> w.SuccessResponse:
        """Close it: the label counts; 409 weights_mixed if it leaves the weights mixed."""
        return self._call(Call("POST", "/end_weight_update", as_(w.SuccessResponse), {}))

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> w.GetWeightsResponse:
        params = {"name": name, "truncate_size": truncate_size}
        return self._call(
            Call("GET", "/get_weights_by_name", as_(w.GetWeightsResponse), params=params)
        )

    def weights_checker(self, action: str = "checksum") -> w.WeightsCheckerResponse:
        """snapshot | reset_tensors | compare | checksum (sha256 of every HF-named tensor)."""
        body = {"action": action}
        return self._call(Call("POST", "/weights_checker", as_(w.WeightsCheckerResponse), body))

    def pull_weights(
        self,
        source_dir: str,
        target_version: int,
        *,
        weight_version: w.Version = None,
        local_checkpoint_dir: str | None = None,
        token_step: int | str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        catalog_path: str | None = None,
    ) -> w.UpdateWeightsResponse:
        """/pull_weights (miles' disk delta): the server applies
        `source_dir/weight_v{target_version:06d}` onto the served weights in place, or onto
        `local_checkpoint_dir` (version 0 seeds it) without writing a served weight."""
        body = compact(
            source_dir=str(source_dir),
            target_version=int(target_version),
            local_checkpoint_dir=local_checkpoint_dir,
            weight_version=w.version_str(weight_version),
            token_step=token_step,
            flush_cache=flush_cache,
            abort_all_requests=abort_all_requests,
            catalog_path=catalog_path,
        )
        return self._call(
            Call("POST", "/pull_weights", as_(w.UpdateWeightsResponse), body, kind="update")
        )

    def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: w.Version = None,
        token_step: int | str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        load_format: str | None = None,
        catalog_path: str | None = None,
    ) -> w.UpdateWeightsResponse:
        """`catalog_path`: the catalog (a JSONL on the server) of these weights, installed with
        them; a catalog that does not load refuses the whole update."""
        body = compact(
            catalog_path=catalog_path,
            model_path=str(model_path),
            weight_version=w.version_str(weight_version),
            token_step=token_step,
            flush_cache=flush_cache,
            abort_all_requests=abort_all_requests,
            load_format=load_format,
        )
        return self._call(
            Call(
                "POST",
                "/update_weights_from_disk",
                as_(w.UpdateWeightsResponse),
                body,
                kind="update",
            )
        )

    def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[str],
        *,
        load_format: str | None = "flattened_bucket",
        weight_version: w.Version = None,
        token_step: int | str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        catalog_path: str | None = None,
    ) -> w.UpdateWeightsResponse:
        """One chunk: one base64 payload per TP rank (grctl has one). Keep the payload's
        tensors alive until this returns: the server reads them during the call.
        `catalog_path`: the catalog of these weights, installed with this chunk."""
        body = compact(
            catalog_path=catalog_path,
            serialized_named_tensors=list(serialized_named_tensors),
            weight_version=w.version_str(weight_version),
            token_step=token_step,
            flush_cache=flush_cache,
            abort_all_requests=abort_all_requests,
        )
        body["load_format"] = load_format  # always sent, null included (slime does)
        return self._call(
            Call(
                "POST",
                "/update_weights_from_tensor",
                as_(w.UpdateWeightsResponse),
                body,
                kind="update",
            )
        )

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = w.DEFAULT_GROUP,
        backend: str | None = None,
    ) -> w.SuccessResponse:
        body = compact(
            master_address=master_address,
            master_port=master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        )
        return self._call(
            Call("POST", "/init_weights_update_group", as_(w.SuccessResponse), body, kind="update")
        )

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str = w.DEFAULT_GROUP,
        load_format: str | None = None,
        weight_version: w.Version = None,
        token_step: int | str | None = None,
        flush_cache: bool = True,
        catalog_path: str | None = None,
    ) -> w.SuccessResponse:
        body = compact(
            catalog_path=catalog_path,
            names=list(names),
            dtypes=[name_of(d) for d in dtypes],
            shapes=[list(s) for s in shapes],
            group_name=group_name,
            load_format=load_format,
            weight_version=w.version_str(weight_version),
            token_step=token_step,
            flush_cache=flush_cache,
        )
        return self._call(
            Call(
                "POST",
                "/update_weights_from_distributed",
                as_(w.SuccessResponse),
                body,
                kind="update",
            )
        )

    def destroy_weights_update_group(self, group_name: str = w.DEFAULT_GROUP) -> w.SuccessResponse:
        body = {"group_name": group_name}
        return self._call(
            Call("POST", "/destroy_weights_update_group", as_(w.SuccessResponse), body)
        )
