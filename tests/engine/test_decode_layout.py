"""A decode step over requests of very different shapes: each request's logits and beam KV equal
the request decoded alone, every context (and a prefix several contexts continue) is read where
it lies, never copied or padded, and a shared prefix is read once per layer."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import profile

from grctl.engine.decode_batch import DecodeItem
from grctl.engine.kv_cache import BeamKV, ContextKV
from grctl.engine.model_runner import ModelRunner
from grctl.model import attention
from tests.support.reference import hf_and_ours

# (prompt length, beams, decode step it joins at): one long wide request, short narrow ones,
# joining one after another as continuous batching admits them
SHAPES = [(400, 16, 0), (3, 1, 1), (37, 5, 1), (1, 2, 2), (150, 1, 3)]
STEPS = 4  # decode steps of the whole schedule; a request runs from its join to the end


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(hf_and_ours(seed=7)[1], torch.device("cpu"))


def prompts(vocab: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen) for n, _, _ in SHAPES]


def beam_kv(runner, n: int) -> BeamKV:
    cfg = runner.config
    return BeamKV(
        cfg.num_layers, n, cfg.num_kv_heads, STEPS, cfg.head_dim, runner.dtype, runner.device
    )


def schedule(runner, ctxs, tokens, together: bool):
    """Decode every request from its join step to STEPS, all in one batch per step or each one
    alone -> ({(request, step): logits}, each request's BeamKV)."""
    kvs = [beam_kv(runner, n) for _, n, _ in SHAPES]
    logits = {}
    for t in range(STEPS):
        live = [r for r, (_, _, join) in enumerate(SHAPES) if join <= t]
        items = {r: DecodeItem(ctxs[r], kvs[r], tokens[r][:, t - SHAPES[r][2]], t - SHAPES[r][2])
                 for r in live}  # fmt: skip
        batches = [live] if together else [[r] for r in live]
        for batch in batches:
            out = runner.decode([items[r] for r in batch])
            rows = 0
            for r in batch:
                n = SHAPES[r][1]
                logits[r, t] = out[rows : rows + n]
                rows += n
    return logits, kvs


def assert_mixed_equals_alone(runner, atol: float) -> None:
    cfg, dev = runner.config, runner.device
    ctxs, _ = runner.prefill([p.to(dev) for p in prompts(cfg.vocab_size)])
    gen = torch.Generator().manual_seed(1)
    tokens = [
        torch.randint(0, cfg.vocab_size, (n, STEPS), generator=gen).to(dev) for _, n, _ in SHAPES
    ]
    together, kv_together = schedule(runner, ctxs, tokens, together=True)
    alone, kv_alone = schedule(runner, ctxs, tokens, together=False)
    assert together.keys() == alone.keys()
    for key in alone:
        assert (together[key] - alone[key]).abs().max() < atol, key
    for a, b, (_, _, join) in zip(kv_together, kv_alone, SHAPES, strict=True):
        written = STEPS - join  # the slots of the tokens it fed
        diff = a.data[..., :written, :].float() - b.data[..., :written, :].float()
        assert diff.abs().max() < atol


def test_mixed_batch_equals_each_request_alone(runner):
    assert_mixed_equals_alone(runner, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_mixed_batch_through_graphs_equals_each_request_alone(dtype):
    """On CUDA the same layout runs between graph replays, and the fused kernel takes every
    request's strided query view (it never fell back to the math path)."""
    runner = ModelRunner(hf_and_ours(seed=7, dtype=dtype, device="cuda")[1], torch.device("cuda"))
    runner.capture_graphs()
    assert_mixed_equals_alone(runner, atol=1e-4 if dtype == torch.float32 else 0.25)
    assert runner.graphs.num_replays > 0
    assert attention._cuda_fused[0]


def split(ctx: ContextKV, at: int, prefix: ContextKV | None = None) -> ContextKV:
    """ctx as a prefix of `at` tokens (views of it, or `prefix` given) and its own rest."""
    if prefix is None:
        prefix = ContextKV(tuple(k[:, :at] for k in ctx.k), tuple(v[:, :at] for v in ctx.v))
    return ContextKV(tuple(k[:, at:] for k in ctx.k), tuple(v[:, at:] for v in ctx.v), prefix)


def test_contexts_continuing_a_shared_prefix(runner):
    """Two prompts sharing 300 tokens: each decoded over (the first one's prefix KV, its own
    rest) gives the logits of its whole context; the prefix is read once per layer for both."""
    cfg = runner.config
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(0, cfg.vocab_size, (300,), generator=gen)
    tails = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in (20, 90)]
    whole, _ = runner.prefill([torch.cat((shared, t)) for t in tails])
    first = split(whole[0], 300)
    chained = [first, split(whole[1], 300, prefix=first.prefix)]
    assert chained[1].length == whole[1].length and chained[1].prefix is chained[0].prefix
    ids = torch.randint(0, cfg.vocab_size, (2, 4), generator=gen)
    reads = []
    real = attention.attention_with_lse

    def spy(q, k, v):
        reads.append(k.data_ptr())
        return real(q, k, v)

    def step(ctxs):
        items = [DecodeItem(c, beam_kv(runner, 4), ids[i], 0) for i, c in enumerate(ctxs)]
        return runner.decode(items)

    expected = step(whole)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention, "attention_with_lse", spy)
        got = step(chained)
    assert (got - expected).abs().max() < 1e-5
    prefix_reads = [first.prefix.k[layer].data_ptr() for layer in range(cfg.num_layers)]
    assert [reads.count(p) for p in prefix_reads] == [1] * cfg.num_layers
    assert len(reads) == 3 * cfg.num_layers  # the prefix, then each request's own part


def test_no_context_is_copied_or_padded(runner, monkeypatch):
    """Every context call reads the request's own tensors (same storage), and a step allocates
    far less than one context: a 500-token request beside 1-token ones pads nothing."""
    cfg = runner.config
    gen = torch.Generator().manual_seed(4)
    ctxs, _ = runner.prefill([torch.randint(0, cfg.vocab_size, (n,), generator=gen)
                              for n in (500, 1, 2, 1, 3, 1, 2, 1)])  # fmt: skip
    items = [DecodeItem(c, beam_kv(runner, 1), torch.zeros(1, dtype=torch.int64), 0) for c in ctxs]
    owned = {t.data_ptr() for c in ctxs for t in (*c.k, *c.v)}
    reads = []
    real = attention.attention_with_lse

    def spy(q, k, v):
        reads.append((k.data_ptr(), v.data_ptr()))
        return real(q, k, v)

    monkeypatch.setattr(attention, "attention_with_lse", spy)
    runner.decode(items)  # warm-up
    reads.clear()
    with profile(profile_memory=True) as prof:
        runner.decode(items)
    assert len(reads) == len(items) * cfg.num_layers
    assert all(k in owned and v in owned for k, v in reads)
    allocations = [e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0]
    one_context_layer = ctxs[0].k[0].numel() * ctxs[0].k[0].element_size()  # 500 tokens
    # padding the 8 requests to 500 tokens allocates 8 x that per layer, for k and for v; the
    # step's largest temporary is a few rows of activations
    assert max(allocations) < one_context_layer / 4, max(allocations)
    assert sum(allocations) < 2 * 8 * one_context_layer * cfg.num_layers / 4, sum(allocations)
