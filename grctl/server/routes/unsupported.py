"""Routes SGLang (or sglang-miles) serves for transports and features grctl does not have.

Each answers 501 `not_supported` (with SGLang's top-level `success: false` and `message`), its
message naming what to use instead, so a trainer that calls one stops with a reason rather than
a bare 404. Any body is accepted and ignored; the API key still applies.
"""

from __future__ import annotations

from litestar import Request, route

from grctl.errors import NotSupported
from grctl.server.exceptions import SGLANG_ERRORS

RDMA = (
    "grctl has no RDMA transfer engine (Mooncake P2P)",
    "use NCCL instead: /init_weights_update_group then /update_weights_from_distributed, "
    "which is miles' --update-weight-transfer-mode broadcast; or push tensors with "
    "/update_weights_from_tensor",
)
REMOTE_SOURCE = (
    "grctl cannot send its weights to another instance (SGLang's remote_instance load format)",
    "start the new instance with --model-path on the checkpoint, or push the trainer's weights "
    "to it with /update_weights_from_tensor or /update_weights_from_distributed",
)
LORA = (
    "grctl serves no LoRA adapters",
    "merge the adapter into the base weights and push those with /update_weights_from_tensor "
    "or /update_weights_from_distributed",
)
IPC = (
    "grctl has no ZMQ IPC weight transport",
    "send CUDA IPC handles, or shared-memory tensors, with /update_weights_from_tensor",
)

UNSUPPORTED: dict[str, tuple[str, str]] = {
    "/get_remote_instance_transfer_engine_info": RDMA,
    "/remote_instance_transfer_engine_info": RDMA,
    "/init_weights_send_group_for_remote_instance": REMOTE_SOURCE,
    "/send_weights_to_remote_instance": REMOTE_SOURCE,
    "/load_lora_adapter": LORA,
    "/load_lora_adapter_from_tensors": LORA,
    "/load_lora_adapter_from_distributed": LORA,
    "/unload_lora_adapter": LORA,
    "/update_weights_from_ipc": IPC,
}


@route(
    list(UNSUPPORTED),
    http_method=["GET", "POST"],
    opt=SGLANG_ERRORS,
    summary="A transport grctl does not have: 501 naming what to use instead",
)
async def unsupported(request: Request) -> None:
    what, instead = UNSUPPORTED[request.url.path]
    raise NotSupported(f"{request.url.path}: {what}", hint=instead)


unsupported_routes = [unsupported]
