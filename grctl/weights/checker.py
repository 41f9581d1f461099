"""Weight verification: per-tensor sha256 checksums and SGLang's snapshot / reset / compare.

A checksum is taken over the bytes of an HF-named tensor in the served dtype, so a client can
compute the same digest from a checkpoint (cast to that dtype) without asking the server.

`skip` (SGLang's skip_tensor_list) holds name substrings: an HF tensor is left out of reset,
compare and checksum alike when one of them is in its HF name (`model.layers.0.mlp.up_proj.
weight`) or in the fused name SGLang's own model gives it (`model.layers.0.mlp.gate_up_proj.
weight`), so a skip list written against either names the same tensors here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from grctl.errors import ValidationError
from grctl.model.dtypes import name_of
from grctl.weights import apply
from grctl.weights.mapping import resolve
from grctl.weights.views import hf_state_dict

ALGORITHM = "sha256"


def tensor_sha256(t: torch.Tensor) -> str:
    data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()


def digest_of(sums: dict[str, str]) -> str:
    """One sha256 over every (name, checksum) pair in name order: SGLang's per-GPU checksum."""
    h = hashlib.sha256()
    for name in sorted(sums):
        h.update(name.encode())
        h.update(sums[name].encode())
    return h.hexdigest()


def digest_of_ranks(per_gpu: list[str]) -> str:
    """One sha256 over the ranks' per-GPU checksums, in rank order: SGLang's per-engine one."""
    h = hashlib.sha256()
    for digest in per_gpu:
        h.update(digest.encode())
    return h.hexdigest()


def is_skipped(hf_name: str, model: nn.Module, skip: Iterable[str] | None) -> bool:
    if not skip:
        return False
    target = resolve(hf_name, model.config)
    fused = hf_name if target is None else target.param_name
    sglang_name = fused if fused.startswith("lm_head.") else "model." + fused
    return any(s in hf_name or s in sglang_name for s in skip)


def checked_views(
    model: nn.Module, skip: Iterable[str] | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, live view) of every tensor not skipped, in checkpoint order."""
    for name, view in hf_state_dict(model).items():
        if not is_skipped(name, model, skip):
            yield name, view


def checksums(model: nn.Module, skip: Iterable[str] | None = None) -> dict[str, dict]:
    return {
        name: {
            "sha256": tensor_sha256(view),
            "dtype": name_of(view.dtype),
            "shape": list(view.shape),
        }
        for name, view in checked_views(model, skip)
    }


class WeightsChecker:
    """SGLang's weights_checker: snapshot the live weights, randomise them, compare later.

    compare passes when every tensor not skipped equals the snapshot again (slime's and miles'
    --check-weight-update-equal: snapshot, reset_tensors, sync the same weights, compare).
    """

    def __init__(self) -> None:
        self._snapshot: dict[str, torch.Tensor] | None = None

    def snapshot(self, model: nn.Module) -> int:
        self._snapshot = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
        return len(self._snapshot)

    @staticmethod
    def reset_tensors(model: nn.Module, skip: Iterable[str] | None = None, seed: int = 0) -> int:
        """Overwrite every tensor not skipped with noise, through the sink (apply.py)."""
        views = dict(checked_views(model, skip))
        specs = [apply.TensorSpec(n, tuple(v.shape), v.dtype) for n, v in views.items()]
        gen = torch.Generator().manual_seed(seed)

        def noise(name: str) -> torch.Tensor:  # one tensor at a time: no model-sized buffer
            view = views[name]
            return torch.randn(view.shape, generator=gen).to(view.dtype)

        with torch.no_grad():
            return apply.copy(apply.plan(model, specs, require_full=False), noise)

    def compare(self, model: nn.Module, skip: Iterable[str] | None = None) -> list[str]:
        """Each parameter with a tensor not skipped that differs from the snapshot, with its
        max abs error over those tensors."""
        if self._snapshot is None:
            raise ValidationError("no snapshot to compare with", hint="send action=snapshot first")
        errors: dict[str, float] = {}
        for name, view in checked_views(model, skip):
            target = resolve(name, model.config)
            ref = self._snapshot[target.param_name]
            if target.is_shard:
                ref = ref[target.row_start : target.row_end]
            live = view.detach().cpu()
            if not torch.equal(live, ref):
                err = (live.float() - ref.float()).abs().max().item()
                errors[target.param_name] = max(err, errors.get(target.param_name, 0.0))
        return [f"{name} (max_abs_err={err:.6g})" for name, err in errors.items()]
