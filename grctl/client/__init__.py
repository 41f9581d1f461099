"""The grctl client library: what a trainer imports to drive grctl (or SGLang) servers.

    from grctl.client import GRClient, WeightSync

    with GRClient("http://127.0.0.1:8000") as gr:
        print(gr.generate([1, 2, 3], max_new_tokens=4).output_ids)

    with WeightSync(["http://a:8000", "http://b:8000"], verify=True) as sync:
        result = sync.run("/ckpt/step_7", weight_version=7)

GRClient / AsyncGRClient: one typed method per route of docs/http-api.md, each returning its
reply Struct (grctl.protocol). WeightSync: pause -> flush -> push (tensor buckets or a disk
path) -> continue -> verify, on one server or a fleet.
"""

from grctl.client.calls import request_body
from grctl.client.http import DEFAULT_URL, AsyncGRClient, ClientTimeout, ConnectionFailed, GRClient
from grctl.client.outcome import Progress, ServerOutcome, SyncError, SyncResult
from grctl.protocol.generate import GenerateResponse
from grctl.protocol.info import ServerInfo, ServerStatus
from grctl.protocol.weights import (
    UpdateWeightsResponse,
    WeightsCheckerResponse,
    WeightVersionResponse,
)

# The names these replies had before the client and the server shared one set of Structs, kept
# so code that imports them keeps working; each is the same class as its new name.
CheckerResult = WeightsCheckerResponse
GenerateResult = GenerateResponse
Status = ServerStatus
UpdateResult = UpdateWeightsResponse
WeightVersion = WeightVersionResponse

_LAZY = {"WeightSync": "grctl.client.sync", "CheckpointDigests": "grctl.client.verify"}


def __getattr__(name: str):
    # WeightSync and CheckpointDigests need torch: import it only when they are asked for, so a
    # plain HTTP client (and `grctl pause`) starts quickly.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'grctl.client' has no attribute {name!r}")


__all__ = [
    "DEFAULT_URL",
    "AsyncGRClient",
    "CheckpointDigests",
    "ClientTimeout",
    "ConnectionFailed",
    "GRClient",
    "GenerateResponse",
    "Progress",
    "ServerInfo",
    "ServerOutcome",
    "ServerStatus",
    "SyncError",
    "SyncResult",
    "UpdateWeightsResponse",
    "WeightSync",
    "WeightVersionResponse",
    "WeightsCheckerResponse",
    "request_body",
]
