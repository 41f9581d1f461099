"""Weight verification: per-tensor sha256 checksums and SGLang's snapshot / reset / compare.

A checksum is taken over the bytes of an HF-named tensor in the served dtype, so a client can
compute the same digest from a checkpoint (cast to that dtype) without asking the server.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from grctl.errors import ValidationError
from grctl.model.dtypes import name_of
from grctl.weights.views import hf_state_dict

ALGORITHM = "sha256"


def tensor_sha256(t: torch.Tensor) -> str:
    data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()


def checksums(model: nn.Module) -> dict[str, dict]:
    return {
        name: {
            "sha256": tensor_sha256(view),
            "dtype": name_of(view.dtype),
            "shape": list(view.shape),
        }
        for name, view in hf_state_dict(model).items()
    }


class WeightsChecker:
    """SGLang's weights_checker: snapshot the live weights, randomise them, compare later.

    compare passes when every parameter equals the snapshot again (slime's
    --check-weight-update-equal: snapshot, reset_tensors, sync the same weights, compare).
    """

    def __init__(self) -> None:
        self._snapshot: dict[str, torch.Tensor] | None = None

    def snapshot(self, model: nn.Module) -> int:
        self._snapshot = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
        return len(self._snapshot)

    @staticmethod
    def reset_tensors(model: nn.Module, seed: int = 0) -> int:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen).to(p.dtype))
        return sum(1 for _ in model.parameters())

    def compare(self, model: nn.Module) -> list[str]:
        """Each parameter that differs from the snapshot, with its max abs error."""
        if self._snapshot is None:
            raise ValidationError("no snapshot to compare with", hint="send action=snapshot first")
        bad = []
        for name, p in model.named_parameters():
            ref = self._snapshot[name]
            live = p.detach().cpu()
            if not torch.equal(live, ref):
                err = (live.float() - ref.float()).abs().max().item()
                bad.append(f"{name} (max_abs_err={err:.6g})")
        return bad
