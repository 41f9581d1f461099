"""Where /generate reads a body as SGLang 0.5.23 does: sampling_params keys, cached_tokens on an
exact repeat, and n under --parallel-sampling."""

from __future__ import annotations

import pytest

from tests.support.appserver import app_server
from tests.support.serverproc import assert_error

# SGLang 0.5.23's SamplingParams API fields (sglang/srt/sampling/sampling_params.py), each at a
# value that asks nothing grctl lacks
SGLANG_FIELDS = {
    "max_new_tokens": 2,
    "stop": None,
    "stop_token_ids": [],
    "stop_regex": None,
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "beam_width": None,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "no_stop_trim": False,
    "stream_interval": None,
    "logit_bias": None,
    "sampling_seed": 7,
    "custom_params": None,
    "watermark": None,
}
# grctl's own keys beside them
GR_FIELDS = {
    "seed": 7,
    "length_penalty": 0.0,
    "use_catalog": True,
    "exclude_item_ids": None,
    "item_finish_reason": "stop",
    "item_prefix_len": 0,
    "logits_processors": [],
    "choice": None,
}
PROMPT = [3, 1, 4, 1, 5, 9]


@pytest.fixture(scope="module")
def app():
    with app_server("--max-new-tokens", "8") as srv:
        yield srv


@pytest.fixture(scope="module")
def parallel():
    with app_server("--parallel-sampling", "--max-new-tokens", "8") as srv:
        yield srv


def refused(resp, says: str = "") -> None:
    assert says in assert_error(resp, 400, "validation_error")["message"]


def generate(client, **body):
    return client.post("/generate", json={"input_ids": PROMPT, **body})


def test_every_sglang_and_grctl_key_is_taken(app):
    with app.client() as c:
        reply = generate(c, sampling_params={**SGLANG_FIELDS, **GR_FIELDS})
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize("key", ["tempreature", "best_of", "stop_strs_", "beams", "N"])
def test_an_unknown_sampling_key_is_a_400_naming_it(app, key):
    with app.client() as c:
        before = c.get("/status").json()["requests"]["submitted"]
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, key: 1}}
        refused(c.post("/generate", json=body), key)
        batch = {"input_ids": [PROMPT, PROMPT], "sampling_params": [{}, {key: 1}]}
        refused(c.post("/generate", json=batch), key)
        refused(c.post("/submit", json=body), key)
        refused(c.post("/submit_many", json={"requests": [body]}), key)
        assert c.get("/status").json()["requests"]["submitted"] == before  # nothing queued


def test_an_exact_repeat_reports_all_but_its_last_token_cached(app):
    with app.client() as c:
        c.get("/flush_cache")
        sp = {"max_new_tokens": 2}
        first, again = (generate(c, sampling_params=sp).json() for _ in range(2))
        one = [generate(c, input_ids=[11], sampling_params=sp).json() for _ in range(2)]
    assert first["meta_info"]["cached_tokens"] == 0
    assert again["meta_info"]["cached_tokens"] == len(PROMPT) - 1  # SGLang's count
    assert again["output_ids"] == first["output_ids"]
    assert [r["meta_info"]["cached_tokens"] for r in one] == [0, 0]


def test_n_is_beams_by_default(app):
    with app.client() as c:
        reply = generate(c, sampling_params={"n": 3, "max_new_tokens": 3}).json()
    beams = [tuple(b["output_ids"]) for b in reply["meta_info"]["beam_results"]]
    assert reply["meta_info"]["beam_width"] == 3 and len(set(beams)) == 3


def test_parallel_sampling_gives_n_independent_samples(parallel):
    with parallel.client() as c:
        sp = {"max_new_tokens": 4, "temperature": 1.0}
        single = generate(c, sampling_params={**sp, "sampling_seed": 5}).json()
        seeded = generate(c, sampling_params={**sp, "n": 3, "sampling_seed": 5}, rid="x")
        drawn = generate(c, sampling_params={**sp, "n": 16})
        beams = generate(c, sampling_params={**sp, "n": 2, "beam_width": 2}).json()
    assert seeded.status_code == 200 and isinstance(seeded.json(), list)
    # each is a sample of n 1: the seeded single request's, with rid x_0, x_1, x_2 (SGLang)
    assert [r["meta_info"]["id"] for r in seeded.json()] == ["x_0", "x_1", "x_2"]
    for r in seeded.json():
        assert r["output_ids"] == single["output_ids"] and r["meta_info"]["beam_width"] == 1
    samples = [tuple(r["output_ids"]) for r in drawn.json()]
    assert len(samples) == 16 and len(set(samples)) > 1  # drawn apart, not 16 distinct beams
    assert not isinstance(beams, list) and beams["meta_info"]["beam_width"] == 2  # a search


def test_parallel_samples_of_a_batch_come_sample_major(parallel):
    other = [2, 7, 1, 8]
    with parallel.client() as c:
        sp = {"max_new_tokens": 3}
        alone = [generate(c, input_ids=p, sampling_params=sp).json() for p in (PROMPT, other)]
        batch = generate(c, input_ids=[PROMPT, other], sampling_params={**sp, "n": 2}).json()
        mixed = generate(c, input_ids=[PROMPT, other], sampling_params=[{"n": 2}, {"n": 3}])
        two = {"input_ids": PROMPT, "sampling_params": {"n": 2}}
        submit = c.post("/submit", json=two)
        many = c.post("/submit_many", json={"requests": [two]})
    greedy = [r["output_ids"] for r in alone]
    assert [r["output_ids"] for r in batch] == greedy * 2  # prompt i's sample j: j * 2 + i
    refused(mixed, "same n")
    refused(submit, "/generate returns them")
    refused(many, "/generate returns them")
