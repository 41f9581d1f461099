"""The catalog replay against an independent masked reference: transformers' Qwen3 logits, the
allowed children of each prefix found from the catalog file's rows by the test itself, the
filters written out per row in float64; its gradient against the hand-derived one and finite
differences."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from grctl.errors import ValidationError
from grctl.rl.replay import CatalogReplay, Filters
from tests.support.checkpoints import make_hf_model

PROMPTS = [[1, 5, 9], [2, 7], [3, 4, 11, 12]]


def toy_items(seed: int = 0, num: int = 40) -> list[tuple[int, ...]]:
    """3-token items over tokens 20..27 / 30..35 / 40..45, plus 2-token items under 28 and 29."""
    rng = random.Random(seed)
    items: set[tuple[int, ...]] = set()
    while len(items) < num:
        items.add((20 + rng.randrange(8), 30 + rng.randrange(6), 40 + rng.randrange(6)))
    items |= {(28, 30), (28, 31), (29, 33)}
    return sorted(items)


@pytest.fixture(scope="module")
def items():
    return toy_items()


@pytest.fixture(scope="module")
def replay(items, tmp_path_factory):
    path = tmp_path_factory.mktemp("replay") / "catalog.jsonl"
    rows = [json.dumps({"item_id": f"it-{i}", "token_ids": list(p)}) for i, p in enumerate(items)]
    path.write_text("\n".join(rows) + "\n")
    return CatalogReplay.load(str(path), vocab_size=128)


@pytest.fixture(scope="module")
def model():
    return make_hf_model(seed=3)


def allowed(items, prefix, f: Filters):
    """The children of `prefix` a beam may take: those leading to an item not excluded and
    at least min_new_tokens long (a prefix whose items all end sooner is closed)."""
    ids = {f"it-{i}": p for i, p in enumerate(items)}
    excluded = {ids[i] for i in f.exclude_item_ids if i in ids}
    out = set()
    for item in items:
        if item in excluded or item[: len(prefix)] != tuple(prefix) or len(item) <= len(prefix):
            continue
        if len(item) < f.min_new_tokens:
            continue
        out.add(item[len(prefix)])
    return sorted(out)


def reference(logits_row: torch.Tensor, support: list[int], token: int, f: Filters) -> float:
    """One token's behaviour log-probability, row by row in float64 (temperature 0:
    deterministic beams, T = 1 and no filter)."""
    if f.temperature == 0:
        f = Filters(min_new_tokens=f.min_new_tokens, exclude_item_ids=f.exclude_item_ids)
    z = {v: float(logits_row[v]) / f.tau for v in support}
    lse = math.log(sum(math.exp(x) for x in z.values()))
    lp = {v: x - lse for v, x in z.items()}
    keep = set(lp)
    if f.min_p > 0:
        top = max(lp.values())
        keep &= {v for v in lp if lp[v] >= top + math.log(f.min_p)}
    ranked = sorted(lp, key=lambda v: -lp[v])
    if 0 < f.top_k < len(ranked):
        keep &= set(ranked[: f.top_k])
    mass = 0.0
    for v in ranked:
        if mass > f.top_p:
            keep.discard(v)
        mass += math.exp(lp[v])
    lse = math.log(sum(math.exp(lp[v]) for v in keep))
    return lp[token] - lse if token in keep else -math.inf


def forward(model, prompts, outputs):
    seqs = [list(p) + list(o) for p, o in zip(prompts, outputs, strict=True)]
    width = max(map(len, seqs))
    ids = torch.tensor([q + [0] * (width - len(q)) for q in seqs])
    return model(input_ids=ids).logits


FILTERS = [
    Filters(),
    Filters(temperature=0.7),
    Filters(temperature=0.0),  # deterministic beams: T = 1
    Filters(temperature=1.3, top_k=3),
    Filters(top_p=0.6),
    Filters(temperature=0.8, min_p=0.2),
    Filters(top_k=4, top_p=0.8, min_p=0.05),
    Filters(temperature=0.0, top_k=1, top_p=0.1),  # filters do not apply to beam search
]


@pytest.mark.parametrize("f", FILTERS, ids=repr)
def test_replay_equals_the_masked_reference(model, replay, items, f):
    rng = random.Random(7)
    outputs = [list(items[rng.randrange(len(items))]) for _ in PROMPTS]
    with torch.no_grad():
        logits = forward(model, PROMPTS, outputs)
        got = replay.logprobs(logits, PROMPTS, outputs, f)
    wide = logits.double()
    for i, (p, o) in enumerate(zip(PROMPTS, outputs, strict=True)):
        want = [
            reference(wide[i, len(p) - 1 + t], allowed(items, o[:t], f), o[t], f)
            for t in range(len(o))
        ]
        assert got.output[i, : len(o)].tolist() == pytest.approx(want, abs=1e-5)
        assert got.output_mask[i].sum() == len(o)
        plain = torch.log_softmax(wide[i], -1)
        assert got.prompt[i, : len(p) - 1].tolist() == pytest.approx(
            [plain[j, p[j + 1]].item() for j in range(len(p) - 1)], abs=1e-5
        )


def test_exclusions_and_min_new_tokens_against_the_reference(model, replay, items):
    # close a whole first-level prefix: every item under its first item's two tokens
    head = items[0][:2]
    closed = [f"it-{i}" for i, p in enumerate(items) if p[:2] == head]
    f = Filters(exclude_item_ids=(*closed, "it-5", "no-such-item"), min_new_tokens=3)
    outputs = [list(p) for p in items if p not in {items[5]} and p[:2] != head][:3]
    with torch.no_grad():
        logits = forward(model, PROMPTS, outputs)
        got = replay.logprobs(logits, PROMPTS, outputs, f)
    for i, o in enumerate(outputs):
        want = [
            reference(row.double(), allowed(items, o[:t], f), o[t], f)
            for t, row in enumerate(logits[i, len(PROMPTS[i]) - 1 :][:3])
        ]
        assert got.output[i].tolist() == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("f", [Filters(), Filters(exclude_item_ids=("it-0", "it-3", "it-4"))])
def test_every_item_of_the_catalog_sums_to_one(model, replay, items, f):
    """At T = 1 under the catalog, exp(an item's sequence log-probability) over all items the
    request allows is 1: the replay is a distribution over items."""
    excluded = set(f.exclude_item_ids)
    paths = [list(p) for i, p in enumerate(items) if f"it-{i}" not in excluded]
    prompts = [PROMPTS[0]] * len(paths)
    with torch.no_grad():
        got = replay.logprobs(forward(model, prompts, paths), prompts, paths, f)
    assert got.sequence().exp().sum().item() == pytest.approx(1.0, abs=1e-5)


def test_gradient_is_the_hand_derived_one(replay, items):
    """At T = 1 with no filter, d log pi(y_t) / d logits_t = onehot(y_t) - softmax over the
    allowed children, zero outside them."""
    torch.manual_seed(0)
    outputs = [list(items[3]), list(items[-1])]
    prompts = PROMPTS[:2]
    logits = torch.randn(2, 6, 128, dtype=torch.float64, requires_grad=True)
    replay.logprobs(logits, prompts, outputs).output.sum().backward()
    want = torch.zeros_like(logits)
    for i, (p, o) in enumerate(zip(prompts, outputs, strict=True)):
        for t in range(len(o)):
            sup = allowed(items, o[:t], Filters())
            row = logits[i, len(p) - 1 + t].detach()
            want[i, len(p) - 1 + t, sup] = -torch.softmax(row[sup], -1)
            want[i, len(p) - 1 + t, o[t]] += 1
    assert torch.allclose(logits.grad, want, atol=1e-12)


@pytest.mark.parametrize("f", [Filters(temperature=0.7, top_p=0.7), Filters(top_k=2, min_p=0.1)])
def test_gradient_matches_finite_differences(replay, items, f):
    torch.manual_seed(1)
    outputs = [list(items[7]), list(items[-2])]
    logits = torch.randn(2, 6, 128, dtype=torch.float64)
    for i, (p, o) in enumerate(zip(PROMPTS[:2], outputs, strict=True)):
        for t, token in enumerate(o):  # the outputs' tokens the most likely: the filters keep them
            logits[i, len(p) - 1 + t, token] += 3.0
    logits.requires_grad_(True)
    with torch.no_grad():
        lp = replay.logprobs(logits, PROMPTS[:2], outputs, f).output
    assert torch.isfinite(lp).all()

    def fn(x):
        return replay.logprobs(x, PROMPTS[:2], outputs, f).output.sum()

    fn(logits).backward()
    gen = torch.Generator().manual_seed(2)
    for _ in range(4):  # central differences along random directions, in float64
        v = torch.randn(logits.shape, generator=gen, dtype=torch.float64)
        with torch.no_grad():
            fd = (fn(logits + 1e-6 * v) - fn(logits - 1e-6 * v)) / 2e-6
        assert (logits.grad * v).sum().item() == pytest.approx(fd.item(), abs=1e-6)


def test_gradient_flows_into_the_model(model, replay, items):
    outputs = [list(items[1]), list(items[2]), list(items[-1])]
    model.zero_grad()
    got = replay.logprobs(forward(model, PROMPTS, outputs), PROMPTS, outputs, Filters(top_p=0.9))
    got.sequence().sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert sum(g.abs().sum() for g in grads) > 0
    model.zero_grad()


def test_no_catalog_is_the_whole_vocabulary(model):
    outputs = [[60, 61, 2], [90], [5, 5]]
    f = Filters(temperature=0.9, top_k=20)
    with torch.no_grad():
        logits = forward(model, PROMPTS, outputs)
        got = CatalogReplay(None).logprobs(logits, PROMPTS, outputs, f)
    for i, (p, o) in enumerate(zip(PROMPTS, outputs, strict=True)):
        want = [
            reference(logits[i, len(p) - 1 + t].double(), list(range(128)), o[t], f)
            for t in range(len(o))
        ]
        assert got.output[i, : len(o)].tolist() == pytest.approx(want, abs=1e-5)


def test_outputs_the_catalog_did_not_allow_are_refused(replay, items):
    logits = torch.zeros(1, 8, 128)
    with pytest.raises(ValidationError, match="not allowed there"):
        replay.logprobs(logits, [[1]], [[20, 30, 99]])
    with pytest.raises(ValidationError, match="not allowed there"):
        replay.logprobs(logits, [[1]], [list(items[0])], Filters(exclude_item_ids=("it-0",)))
    with pytest.raises(ValidationError, match="runs on past"):
        replay.logprobs(logits, [[1]], [[28, 30, 40]])


def test_filters_read_sampling_params_as_the_server_does():
    assert Filters.of({}) == Filters(temperature=0.0)  # grctl's default: deterministic beams
    sp = {"temperature": 0.7, "top_k": 5, "custom_params": {"exclude_item_ids": ["it-1"]}}
    assert Filters.of(sp) == Filters(temperature=0.7, top_k=5, exclude_item_ids=("it-1",))


@pytest.mark.gpu
def test_replay_on_cuda_equals_the_cpu(model, replay, items):
    outputs = [list(items[4]), list(items[9]), list(items[-1])]
    f = Filters(temperature=0.8, top_p=0.9, exclude_item_ids=("it-0",))
    with torch.no_grad():
        logits = forward(model, PROMPTS, outputs)
        cpu = replay.logprobs(logits, PROMPTS, outputs, f)
        gpu = replay.logprobs(logits.cuda(), PROMPTS, outputs, f)
    assert gpu.output.device.type == "cuda"
    assert torch.allclose(gpu.output.cpu(), cpu.output, atol=1e-5)
    assert torch.allclose(gpu.prompt.cpu(), cpu.prompt, atol=1e-5)


def flashinfer_min_p_support(probs: torch.Tensor, top_k: int, top_p: float, min_p: float):
    """The tokens SGLang's flashinfer sampling path keeps when min_p is set (its sampler.py:
    top_k_renorm_prob, then top_p_renorm_prob on those renormalised probabilities, then
    min_p_sampling_from_probs), written out here: the k most likely, renormalised; of those the
    smallest most-likely set whose mass reaches top_p; then those >= min_p times the max."""
    order = probs.argsort(descending=True)
    kept = order[:top_k]
    p = probs[kept] / probs[kept].sum()
    before = p.cumsum(0) - p
    kept, p = kept[before < top_p], p[before < top_p]
    return set(kept[p >= min_p * p.max()].tolist())


def test_sglangs_flashinfer_min_p_order_keeps_another_support():
    """grctl judges top_k, top_p and min_p on one distribution (docs/http-api.md); SGLang's
    flashinfer path with min_p judges top_p after the top_k renormalisation, which cuts more:
    on a two-level catalog of 7 x 7 items with the same 7 probabilities at every node, top_k 5,
    top_p 0.55, min_p 0.05, grctl's support (the replay's, which equals the server's:
    tests/rl/test_served.py) holds 3 x 3 items, flashinfer's 2 x 2."""
    probs = torch.tensor([0.3, 0.2, 0.1, 0.1, 0.1, 0.1, 0.1], dtype=torch.float64)
    firsts, seconds = list(range(20, 27)), list(range(30, 37))
    items = [(a, b) for a in firsts for b in seconds]
    cat = "\n".join(
        json.dumps({"item_id": f"i{n}", "token_ids": list(p)}) for n, p in enumerate(items)
    )
    replay = CatalogReplay.parse((cat + "\n").encode(), vocab_size=64)
    logits = torch.full((len(items), 2, 64), -30.0, dtype=torch.float64)
    logits[:, 0, firsts] = probs.log()
    logits[:, 1, seconds] = probs.log()
    f = Filters(temperature=1.0, top_k=5, top_p=0.55, min_p=0.05)
    got = replay.logprobs(logits, [[1]] * len(items), [list(p) for p in items], f).sequence()
    ours = {p for p, lp in zip(items, got.tolist(), strict=True) if lp > -math.inf}
    kept = flashinfer_min_p_support(probs, 5, 0.55, 0.05)
    theirs = {(firsts[i], seconds[j]) for i in kept for j in kept}
    assert len(ours) == 9 and len(theirs) == 4 and theirs < ours
