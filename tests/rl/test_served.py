"""The replay and the estimators against a real `grctl serve` (its own process, a tiny random
Qwen3 checkpoint and a small catalog): every beam's behaviour logprobs equal the replay of
transformers' forward on the same checkpoint within 1e-5, and over many seeded requests the
estimators fed with the replies' sampling_logprob and gumbel_threshold find E[r], which the
test enumerates over the whole catalog, within 3 standard errors, where the plain beam mean
is measurably off."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers

from grctl.client.http import GRClient
from grctl.rl.estimators import priority_weights, unordered_set_weights
from grctl.rl.replay import CatalogReplay, Filters
from tests.rl.test_replay import toy_items
from tests.support.checkpoints import make_hf_model

pytestmark = pytest.mark.slow  # a server of its own: about 45 s to start on a loaded machine
PROMPT = [1, 5, 9]


@pytest.fixture(scope="module")
def items():
    return toy_items(seed=1, num=30)


@pytest.fixture(scope="module")
def catalog_path(items, tmp_path_factory):
    path = tmp_path_factory.mktemp("served") / "catalog.jsonl"
    rows = [json.dumps({"item_id": f"it-{i}", "token_ids": list(p)}) for i, p in enumerate(items)]
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.fixture(scope="module")
def peaked_checkpoint(tmp_path_factory):
    """The tiny random Qwen3 with its lm_head scaled by 12: a policy peaked enough over the
    catalog (top items 0.28, 0.21, 0.16) that a mean over distinct beams is visibly biased."""
    model = make_hf_model(seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(12.0)
    path = tmp_path_factory.mktemp("peaked")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def srv(start_server, peaked_checkpoint, catalog_path):
    return start_server("--model-path", str(peaked_checkpoint), "--catalog", str(catalog_path))


@pytest.fixture(scope="module")
def model(peaked_checkpoint):
    return transformers.Qwen3ForCausalLM.from_pretrained(peaked_checkpoint).float().eval()


@pytest.fixture(scope="module")
def replay(catalog_path):
    return CatalogReplay.load(str(catalog_path), vocab_size=128)


def replayed(model, replay, prompt, outputs, f: Filters):
    seqs = [prompt + o for o in outputs]
    width = max(map(len, seqs))
    ids = torch.tensor([q + [0] * (width - len(q)) for q in seqs])
    with torch.no_grad():
        return replay.logprobs(model(input_ids=ids).logits, [prompt] * len(outputs), outputs, f)


REQUESTS = [
    {"temperature": 1.0, "n": 1, "seed": 3},
    {"temperature": 1.0, "n": 6, "seed": 4},
    {"temperature": 0.7, "top_k": 3, "n": 4, "seed": 5},
    {"temperature": 1.2, "top_p": 0.8, "min_p": 0.05, "n": 3, "seed": 6},
    {"temperature": 0.0, "n": 4},
    {"temperature": 1.0, "n": 5, "seed": 7, "exclude_item_ids": ["it-0", "it-1", "it-2", "it-9"]},
    {"temperature": 0.9, "n": 2, "seed": 8, "min_new_tokens": 3},
]


@pytest.mark.parametrize("sp", REQUESTS, ids=lambda sp: ",".join(f"{k}={v}" for k, v in sp.items()))
def test_replay_equals_the_servers_behaviour_logprobs(srv, model, replay, sp):
    with GRClient(srv.url) as gr:
        reply = gr.generate(PROMPT, {**sp, "max_new_tokens": 3}, return_logprob=True)
    beams = reply.meta_info.beam_results
    assert len(beams) == sp["n"]
    outputs = [list(b.output_ids) for b in beams]
    got = replayed(model, replay, PROMPT, outputs, Filters.of(sp))
    for i, b in enumerate(beams):
        served = [e[0] for e in b.meta_info.output_token_logprobs]
        assert got.output[i, : len(served)].tolist() == pytest.approx(served, abs=1e-5)
        assert got.sequence()[i].item() == pytest.approx(b.meta_info.sampling_logprob, abs=1e-5)


def test_estimators_on_served_beams_find_the_exact_expected_reward(srv, model, replay, items):
    """k = 6 beams per request at T = 1, 400 seeded requests; reward 1 for the two likeliest
    items, 0.5 for the next four."""
    k, temperature, requests = 6, 1.0, 400
    f = Filters(temperature=temperature)
    paths = [list(p) for p in items]
    lq = replayed(model, replay, PROMPT, paths, f).sequence().double()
    assert lq.exp().sum().item() == pytest.approx(1.0, abs=1e-5)
    order = lq.argsort(descending=True).tolist()
    reward = {tuple(paths[i]): 1.0 for i in order[:2]} | {tuple(paths[i]): 0.5 for i in order[2:6]}
    r_all = torch.tensor([reward.get(tuple(p), 0.0) for p in paths], dtype=torch.float64)
    exact = float((lq.exp() * r_all).sum())
    sp = {"max_new_tokens": 3, "temperature": temperature, "n": k}
    plain, prio, us = [], [], []
    with GRClient(srv.url, timeout=120) as gr:
        for start in range(0, requests, 100):
            params = [{**sp, "seed": 1000 + i} for i in range(start, start + 100)]
            for reply in gr.generate_batch([PROMPT] * 100, params, return_logprob=True):
                beams = reply.meta_info.beam_results
                r = torch.tensor([reward.get(tuple(b.output_ids), 0.0) for b in beams])
                q = torch.tensor([b.meta_info.sampling_logprob for b in beams])
                kappa = reply.meta_info.gumbel_threshold
                keys = [b.meta_info.gumbel_key for b in beams]  # what the threshold bounds
                assert kappa is not None and min(keys) > kappa
                by_key = sorted(range(k), key=lambda i: -keys[i])
                assert [beams[i].meta_info.draw_order for i in by_key] == list(range(k))
                plain.append(float(r.mean()))
                prio.append(float((priority_weights(q, kappa) * r).sum()))
                us.append(float((unordered_set_weights(q, whole_support=kappa is None) * r).sum()))

    def mean_se(xs):
        t = torch.tensor(xs, dtype=torch.float64)
        return float(t.mean()), float(t.std() / math.sqrt(len(xs)))

    figures = {n: mean_se(x) for n, x in (("plain", plain), ("priority", prio), ("us", us))}
    print({"exact": exact, **figures})
    for name in ("priority", "us"):
        mean, se = figures[name]
        assert abs(mean - exact) < 3 * se, (name, figures, exact)
    mean, se = figures["plain"]
    assert abs(mean - exact) > 10 * se, (figures, exact)


def served_and_replayed(srv, model, replay, prompt, sp):
    with GRClient(srv.url) as gr:
        reply = gr.generate(prompt, sp, return_logprob=True)
    beams = reply.meta_info.beam_results
    outputs = [list(b.output_ids) for b in beams]
    return reply, beams, replayed(model, replay, prompt, outputs, Filters.of(sp))


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("pinned", [False, True])
def test_replay_of_a_resumed_partial_item(srv, model, replay, items, k, pinned):
    """The prompt ends in the first k tokens of an item (slime's partial rollout): the server
    completes that item, found by the catalog's rule or pinned by item_prefix_len, and the
    replay, told the same, starts at the same trie node."""
    prompt = PROMPT + list(items[3][:k])
    for sp in (
        {"temperature": 1.0, "n": 3, "seed": 11, "max_new_tokens": 3},
        {"temperature": 0.8, "top_k": 2, "n": 1, "seed": 12, "max_new_tokens": 3},
        {"temperature": 0.0, "n": 2, "max_new_tokens": 3, "min_new_tokens": 3 - k},
    ):
        sp = {**sp, "item_prefix_len": k} if pinned else sp
        reply, beams, got = served_and_replayed(srv, model, replay, prompt, sp)
        assert reply.meta_info.item_prefix_len == k
        for i, b in enumerate(beams):
            assert tuple(items[3][:k]) + tuple(b.output_ids) in set(items)
            served = [e[0] for e in b.meta_info.output_token_logprobs]
            assert got.output[i, : len(served)].tolist() == pytest.approx(served, abs=1e-5)
            assert got.sequence()[i].item() == pytest.approx(b.meta_info.sampling_logprob, abs=1e-5)


def test_replay_without_a_catalog_masks_the_stop_ids_before_min_new_tokens(srv, model):
    """use_catalog false: the whole vocabulary, and before min_new_tokens no stop token (the
    server's own edit); a replay that ignored it would be off by log(1 - p(stop)) a token."""
    free = CatalogReplay(None)
    with GRClient(srv.url) as gr:
        first = gr.generate(PROMPT, {"max_new_tokens": 1, "use_catalog": False})
    stop = first.output_ids[0]  # the likeliest first token: a stop id with real mass
    for sp in (
        {"temperature": 1.0, "n": 1, "seed": 5},
        {"temperature": 1.0, "n": 3, "seed": 6},
        {"temperature": 0.0, "n": 2},
    ):
        sp = {**sp, "max_new_tokens": 4, "min_new_tokens": 3, "use_catalog": False}
        sp["stop_token_ids"] = [stop]
        _, beams, got = served_and_replayed(srv, model, free, PROMPT, sp)
        outputs = [list(b.output_ids) for b in beams]
        no_min = Filters.of({k: v for k, v in sp.items() if k != "min_new_tokens"})
        unmasked = replayed(model, free, PROMPT, outputs, no_min)
        for i, b in enumerate(beams):
            assert stop not in b.output_ids[:3]
            served = [e[0] for e in b.meta_info.output_token_logprobs]
            assert got.output[i, : len(served)].tolist() == pytest.approx(served, abs=1e-5)
            assert got.sequence()[i].item() == pytest.approx(b.meta_info.sampling_logprob, abs=1e-5)
            assert abs(unmasked.output[i, 0].item() - served[0]) > 1e-3  # the mask matters


def test_the_replay_needs_the_requests_own_sampling_params(srv, model, replay, items):
    """The figures docs/rl-integration.md gives: over every item a request can draw (its
    support), each token's behaviour logprob replayed with the request's own params (what the
    server reports: test_replay_equals_the_servers_behaviour_logprobs) against the replay as
    plain T = 1 sampling with no filter (the params lost): the worst token's gap."""
    paths = [list(p) for p in items]
    lost = replayed(model, replay, PROMPT, paths, Filters(temperature=1.0)).output
    gaps = {}
    for sp in REQUESTS:
        if not sp.get("temperature") or "exclude_item_ids" in sp or "min_new_tokens" in sp:
            continue  # the filters' support holds every item; exclusions' and min_new's not
        got = replayed(model, replay, PROMPT, paths, Filters.of(sp)).output
        mask = torch.isfinite(got) & (got != 0)
        name = ",".join(f"{k}={v}" for k, v in sp.items() if k not in ("n", "seed"))
        gaps[name] = (got - lost).abs().masked_fill(~mask, 0).max().item()
    print({"worst_token_gap_nats": gaps})
    assert gaps["temperature=1.0"] == 0.0  # nothing lost: T = 1 and no filter
    assert gaps["temperature=0.7,top_k=3"] > 1.0, gaps
    assert gaps["temperature=1.2,top_p=0.8,min_p=0.05"] > 0.3, gaps
