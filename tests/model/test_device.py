"""resolve_device: the one meaning of a --device value, for the loader and the engine alike."""

from __future__ import annotations

import pytest
import torch

from grctl.errors import ValidationError
from grctl.model.device import resolve_device


def test_auto_keeps_a_placed_model_where_it_is():
    assert resolve_device("auto", placed=torch.device("cpu")) == torch.device("cpu")


def test_auto_without_a_model_is_cuda_when_available_else_cpu():
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == want


def test_explicit_devices():
    assert resolve_device("cpu", placed=torch.device("meta")) == torch.device("cpu")
    if torch.cuda.is_available():
        assert resolve_device("cuda") == torch.device("cuda", torch.cuda.current_device())
    else:
        with pytest.raises(ValidationError, match="CUDA is not available"):
            resolve_device("cuda:0")
