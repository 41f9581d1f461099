"""slime's and miles' own rollout code against a real `grctl serve` with an item catalog.

Their `generate` (slime/rollout/sglang_rollout.py, miles/rollout/sglang_rollout.py) builds the
/generate body, posts it and updates the Sample from the reply through their Sample's own
update (utils/types.py: append_response_tokens / update_from_meta_info), all run unchanged
from a snapshot of each repository (tests/support/peers.py; skipped without one). Only
third-party modules they import at module level and that are not installed here are stubbed.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import json
import math
import random
import time
from argparse import Namespace
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from tests.support.checkpoints import load_hf
from tests.support.peers import peer_package

pytestmark = pytest.mark.timeout(240)

# Items of DEPTH tokens whose first token (20..27) no item holds further along: the catalog is
# self-delimiting, so a prompt ending in part of an item resumes inside it (docs/catalog.md).
DEPTH = 16
BEGIN, LATER = range(20, 28), range(40, 128)
PROMPT = "t3 t1 t4 t1 t5"  # the word tokenizer's spelling of [3, 1, 4, 1, 5]
PROMPT_IDS = [3, 1, 4, 1, 5]
PEERS = {
    "slime": ("THUDM/slime", ("ray", "PIL", "pylatexenc")),
    "miles": (
        "radixark/miles",
        (
            "pybase64",
            "ray",
            "ray.util",
            "ray.util.scheduling_strategies",
            "ray.util.state",
            "sglang",
            "sglang.srt",
            "sglang.srt.entrypoints",
            "sglang.srt.entrypoints.openai",
            "sglang.srt.entrypoints.openai.protocol",
            "sglang.srt.debug_utils",
            "sglang.srt.debug_utils.dumper",
            "pylatexenc",
        ),
    ),
}


def write_items(path: Path, num: int = 60, seed: int = 5) -> dict[tuple[int, ...], list[int]]:
    rng = random.Random(seed)
    items: dict[tuple[int, ...], list[int]] = {}
    lines = []
    for i in range(num):
        toks = [rng.choice(BEGIN)] + [rng.choice(LATER) for _ in range(DEPTH - 1)]
        items.setdefault(tuple(toks), []).append(i)
        lines.append(json.dumps({"item_id": i, "token_ids": toks}))
    path.write_text("\n".join(lines) + "\n")
    return items


@pytest.fixture(scope="module")
def served(start_server, checkpoint, tmp_path_factory):
    ckpt = checkpoint(seed=7, tokenizer=True)
    root = tmp_path_factory.mktemp("items")
    items = write_items(root / "items.jsonl")
    srv = start_server("--model-path", str(ckpt), "--catalog", str(root / "items.jsonl"))
    return srv, ckpt, items


def trainer_args(name: str, srv, ckpt: Path, **over) -> Namespace:
    """The arguments their generate and GenerateState read (slime's and miles' argument names,
    their defaults where the test does not care): one engine, greedy, 8 new tokens at most."""
    args = dict(
        ci_test=False,
        hf_checkpoint=str(ckpt),
        chat_template_path=None,
        sglang_router_ip="127.0.0.1",
        sglang_router_port=srv.port,
        sglang_server_concurrency=4,
        sglang_dp_size=None,
        sglang_router_policy=None,
        router_policy=None,
        rollout_num_engines=1,
        rollout_num_gpus=1,
        rollout_num_gpus_per_engine=1,
        eval_num_gpus=0,
        use_distributed_post=False,
        rollout_temperature=0.0,
        rollout_top_p=1.0,
        rollout_top_k=-1,
        rollout_max_response_len=DEPTH + 8,
        rollout_stop=None,
        rollout_stop_token_ids=None,
        rollout_skip_special_tokens=False,
        sglang_enable_deterministic_inference=False,
        sglang_speculative_algorithm=None,
        use_rollout_routing_replay=False,
        use_rollout_indexer_replay=False,
        partial_rollout=False,
        mask_offpolicy_in_partial_rollout=False,
        num_layers=2,
    )
    args.update(over)
    return Namespace(**args)


@contextmanager
def trainer(name: str, tmp_path: Path, srv, ckpt: Path) -> Iterator[Namespace]:
    """The trainer's modules imported from its snapshot, and its arguments."""
    repo, stubs = PEERS[name]
    with peer_package(repo, name, tmp_path, stubs):
        yield Namespace(
            rollout=importlib.import_module(f"{name}.rollout.sglang_rollout"),
            http=importlib.import_module(f"{name}.utils.http_utils"),
            Sample=importlib.import_module(f"{name}.utils.types").Sample,
            args=trainer_args(name, srv, ckpt),
        )


def run(t: Namespace, flow) -> object:
    """flow(t) on a fresh event loop with the trainer's HTTP client on it, closed after."""

    async def main():
        t.http.init_http_client(t.args)
        try:
            return await flow(t)
        finally:
            await t.http._http_client.aclose()
            t.http._http_client = None

    return asyncio.run(main())


async def generate(t: Namespace, sample, extra: dict | None = None):
    """One turn of the trainer's own generate(), with the sampling params generate_and_rm_group
    hands it (GenerateState's)."""
    params = t.rollout.GenerateState(t.args).sampling_params.copy()
    params.update(extra or {})
    return await t.rollout.generate(t.args, sample, params)


def run_generate(name: str, tmp_path: Path, srv, ckpt: Path, extra: dict | None = None):
    """One sample of PROMPT through the trainer's own generate(); returns it and its Status."""
    with trainer(name, tmp_path, srv, ckpt) as t:

        async def flow(t):
            return await generate(t, t.Sample(prompt=PROMPT, index=0), extra)

        return run(t, flow), t.Sample.Status


@pytest.mark.parametrize("name", ["slime", "miles"])
def test_a_catalog_sample_is_completed(name, served, tmp_path):
    srv, ckpt, items = served
    sample, status = run_generate(name, tmp_path, srv, ckpt)
    response = sample.tokens[len(PROMPT_IDS) :]
    assert sample.tokens[: len(PROMPT_IDS)] == PROMPT_IDS
    assert tuple(response) in items, response  # one whole catalog item, under the tokens allowed
    assert sample.status == status.COMPLETED
    assert sample.response_length == len(response) == len(sample.rollout_log_probs) == DEPTH
    assert all(lp <= 0.0 for lp in sample.rollout_log_probs)
    assert len(sample.weight_versions) == 1


@pytest.mark.parametrize("name", ["slime", "miles"])
def test_item_complete_on_request_leaves_their_sample_pending(name, served, tmp_path):
    """The opt-in keeps grctl's own finish type: their update knows nothing of it."""
    srv, ckpt, items = served
    opt_in = {"item_finish_reason": "item_complete"}
    sample, status = run_generate(name, tmp_path, srv, ckpt, opt_in)
    assert tuple(sample.tokens[len(PROMPT_IDS) :]) in items
    assert sample.status == status.PENDING


async def abort_all(name: str, t: Namespace, url: str) -> None:
    """The trainer's own abort of its engines: slime's abort_servers_until_idle (its rollout's
    abort()), miles' POST /abort_request {"abort_all": true} through its http_utils.post (its
    rollout's abort(), after the router lists the workers)."""
    if name == "slime":
        control = importlib.import_module("slime.backends.sglang_utils.server_control")
        await control.abort_servers_until_idle([url])
    else:
        await t.http.post(f"{url}/abort_request", {"abort_all": True})


@pytest.mark.parametrize("name", ["slime", "miles"])
def test_partial_rollout_aborted_mid_item_resumes_into_the_same_item(name, served, tmp_path):
    """Their partial rollout: the sample is aborted in the middle of an item (the abort is timed
    against an unaborted run, retried until it lands inside the item), keeps the tokens
    generated so far, and is generated again with them appended to the prompt. Greedy, so the
    unaborted run defines the answer: the resumed sample is that one item, COMPLETED."""
    srv, ckpt, items = served
    with trainer(name, tmp_path, srv, ckpt) as t:

        async def flow(t):
            began = time.monotonic()
            whole = await generate(t, t.Sample(prompt=PROMPT, index=0))
            took = time.monotonic() - began
            assert whole.status == t.Sample.Status.COMPLETED
            for attempt in range(12):
                sample = t.Sample(prompt=PROMPT, index=1)
                task = asyncio.create_task(generate(t, sample))
                await asyncio.sleep(took * (0.2 + 0.6 * ((attempt * 0.37) % 1)))
                await abort_all(name, t, srv.url)
                sample = await task
                if sample.status == t.Sample.Status.ABORTED and 0 < sample.response_length < DEPTH:
                    break
            else:
                pytest.fail("no abort landed inside an item in 12 tries")
            return whole, sample, sample.response_length, await generate(t, sample)

        whole, sample, cut, resumed = run(t, flow)
    status = t.Sample.Status
    assert 0 < cut < DEPTH
    assert resumed is sample and resumed.status == status.COMPLETED
    response = resumed.tokens[len(PROMPT_IDS) :]
    assert tuple(response) in items  # one valid item, not a new one after a fragment
    assert resumed.tokens == whole.tokens  # the unaborted run's item
    assert resumed.response_length == DEPTH == len(resumed.rollout_log_probs)
    assert resumed.rollout_log_probs == pytest.approx(whole.rollout_log_probs, abs=1e-4)


def top_p_support(
    hf, prompt: list[int], response: list[int], temperature: float, top_p: float, allowed
) -> list[tuple[set[int], set[int]]]:
    """The test's own top-p support of each response token from transformers' logits: the
    tokens allowed (allowed(prefix) -> ids, or None: the vocabulary), tempered, renormalised
    over those, kept while the mass before a token is at most top_p. Per token (sure, unsure):
    unsure are the tokens whose mass before lies within 1e-5 of top_p (float32 on the server)."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].double()
    out = []
    for t, row in enumerate(logits):
        x = row / temperature
        ids = allowed(response[:t])
        if ids is not None:
            keep = torch.zeros_like(x, dtype=torch.bool)
            keep[list(ids)] = True
            x = x.masked_fill(~keep, -math.inf)
        probs, order = torch.softmax(x, -1).sort(descending=True)
        before = probs.cumsum(0) - probs
        live = probs > 0
        sure = order[live & (before <= top_p - 1e-5)].tolist()
        unsure = order[live & ((before - top_p).abs() < 1e-5)].tolist()
        out.append((set(sure), set(unsure)))
    return out


@pytest.mark.parametrize("use_catalog", [False, True])
def test_slime_top_p_replay_gets_each_tokens_support(served, tmp_path, use_catalog):
    """slime with --rollout-top-p below 1 (its custom_params.return_top_p_token_ids): its own
    Sample update stores the reply's top_p_token_ids / offsets, its own length checks hold, and
    each token's kept ids are the top-p support of transformers' logits (under the catalog: of
    the items' next tokens)."""
    srv, ckpt, items = served
    temperature, top_p = 0.8, 0.7

    def children(prefix: list[int]) -> set[int] | None:
        if not use_catalog:
            return None
        return {path[len(prefix)] for path in items if list(path[: len(prefix)]) == prefix}

    with trainer("slime", tmp_path, srv, ckpt) as t:
        t.args.rollout_temperature, t.args.rollout_top_p = temperature, top_p
        assert t.rollout.GenerateState(t.args).sampling_params["custom_params"] == {
            "return_top_p_token_ids": True
        }

        async def flow(t):
            extra = {"use_catalog": use_catalog}
            return [await generate(t, t.Sample(prompt=PROMPT, index=i), extra) for i in range(2)]

        samples = run(t, flow)
    hf = load_hf(ckpt)
    for sample in samples:
        response = sample.tokens[len(PROMPT_IDS) :]
        ids = sample.rollout_top_p_token_ids.tolist()
        offsets = sample.rollout_top_p_token_offsets.tolist()
        assert len(offsets) == sample.response_length + 1 == len(response) + 1  # slime's checks
        assert offsets[0] == 0 and offsets[-1] == len(ids)
        if use_catalog:
            assert tuple(response) in items
        ref = top_p_support(hf, PROMPT_IDS, response, temperature, top_p, children)
        for i, (tok, (sure, unsure)) in enumerate(zip(response, ref, strict=True)):
            kept = ids[offsets[i] : offsets[i + 1]]
            assert len(set(kept)) == len(kept) and tok in kept
            assert sure <= set(kept) <= sure | unsure, (i, sorted(kept), sorted(sure))
        if not use_catalog:  # the vocabulary's support, not a token or two
            assert max(b - a for a, b in itertools.pairwise(offsets)) > 8
