"""Our Qwen3 against transformers.Qwen3ForCausalLM on the same weights.

Both the reference forward (full logits, KV cache) and the engine's own passes (packed prefill,
shared-context decode) must give transformers' logits: fp32 max abs diff < 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from grctl.engine.decode_batch import DecodeItem
from grctl.engine.kv_cache import BeamKV
from grctl.engine.model_runner import ModelRunner
from tests.support.reference import hf_and_ours

TOL = 1e-4
# tied / untied, GQA ratios 1, 2 and 4, head_dim != hidden / heads in each
CONFIGS = {
    "untied-gqa2": dict(),
    "tied-gqa1": dict(tie_word_embeddings=True, num_key_value_heads=4, head_dim=32),
    "tied-gqa4": dict(
        tie_word_embeddings=True, num_attention_heads=8, num_key_value_heads=2, head_dim=12
    ),
    "untied-gqa4-3layers": dict(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=40
    ),
}


def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids).logits.float()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request):
    return hf_and_ours(seed=len(request.param), **CONFIGS[request.param])


@pytest.mark.parametrize("seq_len", [1, 2, 7, 33, 64])
def test_prefill_logits(pair, seq_len):
    hf, ours = pair
    ids = torch.randint(
        0, ours.config.vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(seq_len)
    )
    logits, _ = ours(ids)
    assert (logits - hf_logits(hf, ids)).abs().max() < TOL


def test_decode_with_kv_cache(pair):
    hf, ours = pair
    ids = torch.randint(
        0, ours.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1)
    )
    ref = hf_logits(hf, ids)
    logits, past = ours(ids[:, :5])
    assert (logits - ref[:, :5]).abs().max() < TOL
    for t in range(5, 12):  # token by token, each step reading the cache
        logits, past = ours(ids[:, t : t + 1], past_kv=past)
        assert (logits[:, 0] - ref[:, t]).abs().max() < TOL
        assert past[0][0].shape[1] == t + 1


def test_engine_passes_match(pair):
    """Packed prefill of mixed lengths, then shared-context decode of 3 beams for 3 steps."""
    hf, ours = pair
    cfg = ours.config
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in (1, 9, 64, 30)]
    runner = ModelRunner(ours, torch.device("cpu"))
    ctxs, logprobs = runner.prefill(prompts)
    for p, lp in zip(prompts, logprobs, strict=True):
        ref = torch.log_softmax(hf_logits(hf, p[None])[0, -1], -1)
        assert (lp - ref).abs().max() < TOL
    beams = [torch.randint(0, cfg.vocab_size, (3, 3), generator=gen) for _ in prompts]
    kvs = [
        BeamKV(cfg.num_layers, 3, cfg.num_kv_heads, 3, cfg.head_dim, torch.float32, "cpu")
        for _ in prompts
    ]
    for step in range(3):
        items = [
            DecodeItem(c, kv, b[:, step], step) for c, kv, b in zip(ctxs, kvs, beams, strict=True)
        ]
        out = runner.decode(items)
        rows = [
            torch.cat([p, b[i, : step + 1]])
            for p, b in zip(prompts, beams, strict=True)
            for i in range(3)
        ]
        ref = torch.stack([hf_logits(hf, r[None])[0, -1] for r in rows])
        assert (out - ref).abs().max() < TOL  # decode returns logits


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_smoke(dtype):
    hf, ours = hf_and_ours(dtype=dtype)
    ids = torch.randint(
        0, ours.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(3)
    )
    logits, past = ours(ids)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert past[0][0].dtype == dtype
    ref = hf_logits(hf_and_ours()[0], ids)
    assert (logits - ref).abs().max() < 0.25  # half precision, same weights
    ctxs, lp = ModelRunner(ours, torch.device("cpu")).prefill([ids[0]])
    assert ctxs[0].k[0].dtype == dtype and torch.isfinite(lp).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_parity(dtype):
    hf, ours = hf_and_ours(dtype=dtype, device="cuda", **CONFIGS["tied-gqa4"])
    ids = torch.randint(0, ours.config.vocab_size, (2, 40), device="cuda")
    logits, _ = ours(ids)
    tol = TOL if dtype == torch.float32 else 0.25
    assert (logits - hf_logits(hf, ids)).abs().max() < tol
    ctxs, lp = ModelRunner(ours, torch.device("cuda")).prefill([ids[0], ids[1, :7]])
    ref = torch.log_softmax(hf_logits(hf, ids[1:, :7])[0, -1], -1)
    assert (lp[1] - ref).abs().max() < tol
