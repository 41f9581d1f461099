"""RoPE scaling (linear, dynamic, yarn, llama3) against transformers' Qwen3 logits, from both
config fields (transformers 5's `rope_parameters`, older `rope_scaling`); other types refused."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from grctl.engine.decode_batch import DecodeItem
from grctl.engine.kv_cache import BeamKV
from grctl.engine.model_runner import ModelRunner
from grctl.errors import ValidationError
from grctl.model.config import ModelConfig
from grctl.model.qwen3 import Qwen3ForCausalLM
from grctl.model.rope import RopeScaling
from grctl.weights import apply
from tests.support.appserver import app_server
from tests.support.checkpoints import make_hf_model, write_checkpoint
from tests.support.reference import ROPES, rope_pair
from tests.support.serverproc import REPO_ROOT, assert_error, free_port

TOL = 1e-4

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")


def hf_incremental(hf, prompt: torch.Tensor, fed: list[int]) -> list[torch.Tensor]:
    """transformers' last-token log-probabilities after the prompt, then after each fed token
    through its KV cache, as generate() computes them; the rotary state (which dynamic RoPE
    keeps across calls) starts fresh for each sequence."""
    hf.model.rotary_emb = Qwen3RotaryEmbedding(hf.config)
    with torch.no_grad():
        out = hf(prompt[None], use_cache=True)
        logprobs = [torch.log_softmax(out.logits[0, -1].float(), -1)]
        for tok in fed:
            out = hf(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
            logprobs.append(torch.log_softmax(out.logits[0, -1].float(), -1))
    return logprobs


@pytest.mark.parametrize("field", ["rope_parameters", "rope_scaling"])
@pytest.mark.parametrize("kind", sorted(ROPES))
def test_rope_scaling_matches_transformers(kind, field):
    hf, ours = rope_pair(kind, field)
    cfg = ours.config
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in (5, 40, 61)]
    fed = torch.randint(0, cfg.vocab_size, (len(prompts), 2), generator=gen)
    refs = [hf_incremental(hf, p, f.tolist()) for p, f in zip(prompts, fed, strict=True)]
    runner = ModelRunner(ours, torch.device("cpu"))
    ctxs, logprobs = runner.prefill(prompts)  # packed: each prompt keeps its own length
    kvs = [
        BeamKV(cfg.num_layers, 1, cfg.num_kv_heads, 2, cfg.head_dim, torch.float32, "cpu")
        for _ in prompts
    ]
    steps = [logprobs]
    for step in range(2):
        items = [
            DecodeItem(c, kv, f[step : step + 1], step)
            for c, kv, f in zip(ctxs, kvs, fed, strict=True)
        ]
        steps.append(torch.log_softmax(runner.decode(items), -1))  # decode returns logits
    for step, got in enumerate(steps):
        want = torch.stack([r[step] for r in refs])
        assert (got - want).abs().max() < TOL, (kind, step, (got - want).abs().max())
    # The same weights under plain RoPE give other logits past the original length.
    plain = Qwen3ForCausalLM(dataclasses.replace(cfg, rope=RopeScaling())).eval()
    apply.load_tensors(plain, list(hf.state_dict().items()), require_full=True)
    unscaled = ModelRunner(plain, torch.device("cpu")).prefill(prompts)[1]
    assert (unscaled[2] - logprobs[2]).abs().max() > 1e-3


@pytest.mark.parametrize(
    "params, words",
    [
        ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}, "longrope"),
        ({"type": "su", "factor": 2.0}, "'su'"),
        ({"rope_type": "linear"}, "positive factor"),
        ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, "partial_rotary"),
    ],
)
def test_other_rope_types_are_refused(params, words):
    raw = make_hf_model(seed=0).config.to_dict()
    with pytest.raises(ValidationError, match=words):
        ModelConfig.from_hf({**raw, "rope_parameters": None, "rope_scaling": params})


def test_unsupported_rope_refused_by_serve_and_by_disk_update(tmp_path, checkpoint):
    good = checkpoint(seed=1)
    bad = write_checkpoint(tmp_path / "bad", seed=2)
    cfg_path = bad / "config.json"
    raw = json.loads(cfg_path.read_text())
    raw["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 2.0}
    cfg_path.write_text(json.dumps(raw))
    serve = subprocess.run(
        [
            sys.executable,
            "-m",
            "grctl",
            "serve",
            "--model-path",
            str(bad),
            "--port",
            str(free_port()),
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert serve.returncode == 1 and "longrope" in serve.stderr, serve.stderr[-2000:]
    with app_server("--allow-weight-update", "--model-path", str(good)) as srv, srv.client() as c:
        reply = c.post("/update_weights_from_disk", json={"model_path": str(bad)})
        assert_error(reply, 400, "validation_error")
        assert "longrope" in reply.json()["error"]["message"]
