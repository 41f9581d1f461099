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
import json
import random
from argparse import Namespace
from pathlib import Path

import pytest

from tests.support.peers import peer_package

pytestmark = pytest.mark.timeout(240)

# Semantic-ID levels with their own token ranges (as RQ-VAE codes are): no item path starts with
# a token another item holds deeper.
LEVELS = (range(20, 28), range(40, 56), range(60, 100))
PROMPT = "t3 t1 t4 t1 t5"  # the word tokenizer's spelling of [3, 1, 4, 1, 5]
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
        toks = [rng.choice(level) for level in LEVELS]
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
        rollout_max_response_len=8,
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


def run_generate(name: str, tmp_path: Path, srv, ckpt: Path, extra: dict | None = None):
    """One sample of PROMPT through the trainer's own generate(); returns it and its Status."""
    repo, stubs = PEERS[name]
    with peer_package(repo, name, tmp_path, stubs):
        rollout = importlib.import_module(f"{name}.rollout.sglang_rollout")
        http_utils = importlib.import_module(f"{name}.utils.http_utils")
        types_ = importlib.import_module(f"{name}.utils.types")
        args = trainer_args(name, srv, ckpt)

        async def once():
            http_utils.init_http_client(args)  # their client lives on this loop
            try:
                state = rollout.GenerateState(args)
                params = state.sampling_params.copy()  # what generate_and_rm_group hands on
                params.update(extra or {})
                sample = types_.Sample(prompt=PROMPT, index=0)
                return await rollout.generate(args, sample, params)
            finally:
                await http_utils._http_client.aclose()

        return asyncio.run(once()), types_.Sample.Status


@pytest.mark.parametrize("name", ["slime", "miles"])
def test_a_catalog_sample_is_completed(name, served, tmp_path):
    srv, ckpt, items = served
    sample, status = run_generate(name, tmp_path, srv, ckpt)
    prompt = [3, 1, 4, 1, 5]
    response = sample.tokens[len(prompt) :]
    assert sample.tokens[: len(prompt)] == prompt
    assert tuple(response) in items, response  # one whole catalog item, under the 8 allowed
    assert sample.status == status.COMPLETED
    assert sample.response_length == len(response) == len(sample.rollout_log_probs) == 3
    assert all(lp <= 0.0 for lp in sample.rollout_log_probs)
    assert sample.weight_versions == ["builtin"] or len(sample.weight_versions) == 1


@pytest.mark.parametrize("name", ["slime", "miles"])
def test_item_complete_on_request_leaves_their_sample_pending(name, served, tmp_path):
    """The opt-in keeps grctl's own finish type: their update knows nothing of it."""
    srv, ckpt, items = served
    opt_in = {"item_finish_reason": "item_complete"}
    sample, status = run_generate(name, tmp_path, srv, ckpt, opt_in)
    assert tuple(sample.tokens[5:]) in items
    assert sample.status == status.PENDING
