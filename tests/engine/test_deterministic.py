"""--enable-deterministic-inference: a request's tokens and every logprob are bit-identical
(==, not allclose) alone, inside a batch of 17 mixed requests (lengths, widths, greedy and
seeded stochastic, scored prompts), and after a prefix-cache hit or miss; and the kernels
behind it are row-invariant."""

from __future__ import annotations

import copy

import pytest
import torch

from grctl.engine.config import EngineConfig
from grctl.engine.engine import Engine
from grctl.engine.request import GenerateRequest, SamplingParams
from grctl.model import batch_invariant
from grctl.rl import forward
from tests.support.engines import run_requests
from tests.support.reference import hf_and_ours

VOCAB = 128


@pytest.fixture(scope="module")
def model():
    return hf_and_ours(seed=3)[1]


def prompt(n: int, seed: int) -> tuple[int, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, VOCAB, (n,), generator=gen).tolist())


def mixed(i: int, shared: tuple[int, ...] = ()) -> GenerateRequest:
    """Request i of a mixed rollout: lengths 3..90, widths 1..8, greedy and seeded sampling,
    top logprobs, every third one scoring its prompt too."""
    n = [5, 40, 17, 70, 9, 33, 64, 3][i % 8] + i
    return GenerateRequest(
        shared + prompt(n, i),
        SamplingParams(
            max_new_tokens=3 + i % 3,
            n=[1, 4, 2, 8, 1, 3][i % 6],
            temperature=[0.0, 1.0][i % 2],
            seed=100 + i,
        ),
        return_logprob=True,
        top_logprobs_num=2,
        logprob_start_len=1 if i % 3 == 0 else -1,
    )


def signature(res) -> list:
    """Everything a trainer reads of a result, as exact values."""
    beams = [
        (b.output_ids, b.output_token_logprobs, b.output_top_logprobs, b.sequence_score)
        for b in res.beams
    ]
    scores = res.prompt_logprobs
    return [beams, None if scores is None else (scores.logprobs, scores.top)]


def engine(model, **kw) -> Engine:
    return Engine(model, EngineConfig(deterministic_inference=True, **kw))


@pytest.mark.slow
def test_alone_equals_inside_a_batch_of_17(model):
    reqs = [mixed(i) for i in range(17)]
    alone = [signature(run_requests(engine(model), [r])[0]) for r in reqs]
    batch = [signature(r) for r in run_requests(engine(model), reqs)]
    assert batch == alone
    shuffled = [reqs[i] for i in (16, 3, 8, 0, 11, 5, 14, 1, 9, 12, 2, 7, 15, 4, 10, 6, 13)]
    results = run_requests(engine(model), shuffled)
    got = {id(r): signature(x) for r, x in zip(shuffled, results, strict=True)}
    assert [got[id(r)] for r in reqs] == alone


@pytest.mark.slow
def test_the_default_mode_is_not_batch_invariant(model):
    """What the flag fixes: the plain kernels give the same request other bits in a batch."""
    reqs = [mixed(i) for i in range(17)]
    plain = Engine(model, EngineConfig())
    alone = [signature(run_requests(plain, [r])[0]) for r in reqs]
    plain.cache.clear()
    batch = [signature(r) for r in run_requests(plain, reqs)]
    assert batch != alone


def test_prefix_cache_hit_equals_miss(model):
    """Prompts continuing a cached 50-token prefix (a hit, the rest computed against the cached
    KV) give what they give with the cache off (a miss)."""
    shared = prompt(50, 999)
    reqs = [mixed(i, shared) for i in range(6)]
    miss = [
        signature(run_requests(engine(model, enable_prefill_cache=False), [r])[0]) for r in reqs
    ]
    eng = engine(model)
    run_requests(eng, [GenerateRequest(shared + (1,), SamplingParams(max_new_tokens=1))])
    hits = run_requests(eng, reqs)
    # a scored prompt (logprob_start_len 1) takes at most its first token from the cache
    assert [r.cached_tokens for r in hits] == [1 if i % 3 == 0 else 50 for i in range(6)]
    assert [signature(r) for r in hits] == miss
    repeat = run_requests(eng, reqs)  # exact repeats and scored prompts, all cached
    assert [signature(r) for r in repeat] == miss


def test_kernels_are_row_invariant():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(75, 64, generator=gen), torch.randn(96, 64, generator=gen)
    full = batch_invariant.linear(x, w)
    for lo, hi in ((0, 1), (3, 4), (40, 75), (31, 33)):
        assert torch.equal(batch_invariant.linear(x[lo:hi], w), full[lo:hi])
    norm_w = torch.randn(64, generator=gen)
    full = batch_invariant.rms_norm(x, norm_w, 1e-6)
    assert torch.equal(batch_invariant.rms_norm(x[40:41], norm_w, 1e-6), full[40:41])
    q = torch.randn(75, 4, 24, generator=gen)
    k, v = torch.randn(2, 75, 24, generator=gen), torch.randn(2, 75, 24, generator=gen)
    pos = torch.arange(75)
    out, lse = batch_invariant.attention(q, k, v, pos)
    sub, sub_lse = batch_invariant.attention(q[60:], k, v, pos[60:])  # after a "cached" prefix
    assert torch.equal(sub, out[60:]) and torch.equal(sub_lse, lse[60:])
    short, _ = batch_invariant.attention(q[:61], k[:, :61], v[:, :61], pos[:61])
    assert torch.equal(short, out[:61])  # keys past a row's position change nothing
    # and it is attention: softmax(q k^T / sqrt(d)) v within float32's error
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(2, 0), v.repeat_interleave(2, 0), is_causal=True
    ).transpose(0, 1)
    assert torch.allclose(out, ref, atol=1e-5)


@pytest.mark.parametrize("threads", [None, 3])
def test_the_cpu_matmul_chunks_are_row_invariant_at_any_row_count(threads):
    """The CPU linear runs its rows as one-thread GEMM chunks of a size that follows the row
    count: a row's bits must not (shapes where a threaded GEMM splits K among them)."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(5)
        for k, n in ((1536, 512), (512, 1536), (96, 16)):
            x, w = torch.randn(300, k, generator=gen), torch.randn(n, k, generator=gen)
            full = batch_invariant.linear(x, w)
            assert torch.allclose(full, x @ w.t(), atol=1e-3)
            for lo, hi in ((0, 1), (7, 9), (5, 37), (100, 165), (31, 300), (1, 299)):
                assert torch.equal(batch_invariant.linear(x[lo:hi], w), full[lo:hi]), (k, n, lo)
    finally:
        torch.set_num_threads(before)


def test_causal_attention_skips_only_blocks_past_each_row():
    """Past 512 keys each tile of a prefill gets the key blocks up to its last row: a row gives
    the same bits whether its call starts before or after a block edge, and whatever follows."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1100, 4, 16, generator=gen)
    k, v = torch.randn(2, 1100, 16, generator=gen), torch.randn(2, 1100, 16, generator=gen)
    pos = torch.arange(1100)
    out, lse = batch_invariant.attention(q, k, v, pos)
    for lo in (450, 511, 1000):  # tiles straddling 512 and 1,024 in the sub-call, not in full
        sub, sub_lse = batch_invariant.attention(q[lo:], k, v, pos[lo:])
        assert torch.equal(sub, out[lo:]) and torch.equal(sub_lse, lse[lo:]), lo
    short, _ = batch_invariant.attention(q[:600], k[:, :600], v[:, :600], pos[:600])
    assert torch.equal(short, out[:600])
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(2, 0), v.repeat_interleave(2, 0), is_causal=True
    ).transpose(0, 1)
    assert torch.allclose(out, ref, atol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_attention_gradients_are_attentions_including_the_lse(causal):
    """The CPU flash kernel's backward takes its lse as a constant; the prefill's key blocks
    and a decode step's merge with its tail both weigh by it, so its gradient must be the
    lse's own: q, k and v gradients of out and lse against float64 attention (300 keys: three
    causal blocks)."""
    gen = torch.Generator().manual_seed(4)

    def leaf(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v = leaf(300, 4, 16), leaf(2, 300, 16), leaf(2, 300, 16)
    w_out, w_lse = leaf(300, 4, 16), leaf(300, 4)
    ours = [t.float().requires_grad_(True) for t in (q, k, v)]
    out, lse = batch_invariant.attention(*ours, torch.arange(300) if causal else None)
    ((out.double() * w_out).sum() + (lse.double() * w_lse).sum()).backward()
    ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
    s = torch.einsum("nhd,hsd->hns", ref[0], ref[1].repeat_interleave(2, 0)) / 4.0
    if causal:
        s = s.masked_fill(torch.ones(300, 300, dtype=torch.bool).triu(1), float("-inf"))
    r_out = torch.einsum("hns,hsd->nhd", s.softmax(-1), ref[2].repeat_interleave(2, 0))
    ((r_out * w_out).sum() + (s.logsumexp(-1).T * w_lse).sum()).backward()
    assert torch.allclose(out.double(), r_out, atol=1e-5)
    for got, want in zip(ours, ref, strict=True):
        assert torch.allclose(got.grad.double(), want.grad, atol=1e-4), (
            (got.grad.double() - want.grad).abs().max()
        )


def test_the_trainer_forward_gradient_is_transformers(model):
    """grctl.rl.forward's gradient (a prompt past one key block, output tokens merged with
    their tails by lse) equals the gradient of transformers' teacher-forced log-probabilities
    of the same tokens, at the same weights."""
    hf, ours = hf_and_ours(seed=3)
    ours = copy.deepcopy(ours).requires_grad_(True)
    ours.set_batch_invariant(True)
    ids, out = torch.tensor(prompt(150, 9)), torch.tensor(prompt(5, 10))
    forward.token_logprobs(forward.server_logits(ours, ids, out), out).sum().backward()
    full = torch.cat((ids, out))[None]
    logits = hf(full).logits[0, len(ids) - 1 : -1].float()
    torch.log_softmax(logits, -1).gather(1, out[:, None]).sum().backward()
    attn = hf.model.layers[0].self_attn
    want = torch.cat([p.weight.grad for p in (attn.q_proj, attn.k_proj, attn.v_proj)])
    got = ours.layers[0].self_attn.qkv_proj.weight.grad
    assert torch.allclose(got, want, rtol=1e-3, atol=1e-5), (got - want).abs().max()


def test_the_trainer_forward_gives_the_server_logprobs_bitwise(model):
    """grctl's Qwen3 as the trainer's forward (grctl.rl.forward), one teacher-forced pass over
    prompt + output, gives the server's logits rows exactly, so every beam's model logprobs
    (return_original_logprob: log_softmax of those rows) are the reply's bit for bit (greedy,
    beams, seeded samples), served inside a batch; and it is differentiable."""
    reqs = [
        GenerateRequest(
            prompt(n, 7 + n),
            SamplingParams(max_new_tokens=m, n=w, temperature=t, seed=n),
            return_logprob=True,
            return_original_logprob=True,
        )
        for n, m, w, t in ((12, 4, 1, 0.0), (37, 3, 4, 0.0), (20, 5, 1, 1.0), (66, 3, 3, 0.7))
    ]
    results = run_requests(engine(model), [mixed(i) for i in range(5)] + reqs)[5:]
    model.set_batch_invariant(True)
    for req, res in zip(reqs, results, strict=True):
        ids = torch.tensor(req.input_ids)
        for beam in res.beams:
            out = torch.tensor(beam.output_ids)
            rows = forward.server_logits(model, ids, out)
            got = forward.token_logprobs(rows, out)
            assert got.tolist() == beam.output_token_logprobs
    trainer = copy.deepcopy(model).requires_grad_(True)
    rows = forward.server_logits(trainer, ids, out)
    forward.token_logprobs(rows, out).sum().backward()
    assert trainer.layers[0].self_attn.qkv_proj.weight.grad.abs().sum() > 0
    plain = copy.deepcopy(model)
    plain.set_batch_invariant(False)
    with pytest.raises(ValueError, match="set_batch_invariant"):
        forward.server_logits(plain, ids, out)


def test_the_block_attention_of_other_devices_is_row_invariant_too():
    """The path CUDA takes (fixed 64-key blocks merged in order), run here on the CPU."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(150, 4, 24, generator=gen)
    k, v = torch.randn(2, 150, 24, generator=gen), torch.randn(2, 150, 24, generator=gen)
    pos = torch.arange(150)
    out, lse = batch_invariant.block_attention(q, k, v, pos)
    sub, sub_lse = batch_invariant.block_attention(q[97:], k, v, pos[97:])
    assert torch.equal(sub, out[97:]) and torch.equal(sub_lse, lse[97:])
    short, _ = batch_invariant.block_attention(q[:70], k[:, :70], v[:, :70], pos[:70])
    assert torch.equal(short, out[:70])
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(2, 0), v.repeat_interleave(2, 0), is_causal=True
    ).transpose(0, 1)
    assert torch.allclose(out, ref, atol=1e-5)
    whole, whole_lse = batch_invariant.block_attention(q[:5], k, v)  # decode: every key
    assert torch.allclose(
        whole_lse,
        torch.logsumexp(
            torch.einsum("nhd,hsd->nhs", q[:5], k.repeat_interleave(2, 0)) * 24**-0.5, -1
        ),
        atol=1e-5,
    )
    assert torch.equal(batch_invariant.block_attention(q[3:5], k, v)[0], whole[3:5])


@pytest.mark.slow
def test_alone_equals_inside_a_batch_at_a_large_vocabulary():
    """At a 50,000-token vocabulary a reduction over the step's [rows, vocab] logits followed the
    row count: a seeded sample's score differed in its last bits alone and in a batch."""
    vocab = 50_000
    big = hf_and_ours(seed=3, vocab_size=vocab)[1]

    def req(i: int) -> GenerateRequest:
        gen = torch.Generator().manual_seed(i)
        ids = tuple(torch.randint(0, vocab, ([5, 40, 17, 70, 9][i % 5] + i,), generator=gen))
        sp = SamplingParams(
            max_new_tokens=3, n=[1, 4, 2, 1, 3][i % 5], temperature=[0.0, 1.0][i % 2], seed=100 + i
        )
        return GenerateRequest(tuple(map(int, ids)), sp, return_logprob=True, top_logprobs_num=2)

    reqs = [req(i) for i in range(6)]
    alone = [signature(run_requests(engine(big), [r])[0]) for r in reqs]
    assert [signature(r) for r in run_requests(engine(big), reqs)] == alone
