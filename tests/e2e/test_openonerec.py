"""OpenOneRec's vocabulary and catalog on a real `grctl serve`.

A tiny random Qwen3 with a byte-level tokenizer is expanded with OpenOneRec's SID tokens, by
the expansion done here (tests/support/onerec.py) and, with a snapshot of OpenOneRec, by its own
expand_qwen3_vocab.py. `grctl catalog from-sids` turns a pid -> SID table (OpenOneRec's text
form, and its pid2sid parquet of code lists) into the catalog through that tokenizer; the server
then answers a prompt ending in `</think>` and the forced `\\n<|sid_begin|>` with beams that are
each a whole item closed by `<|sid_end|>`, as transformers' constrained beam search finds them.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import transformers
from typer.testing import CliRunner

from grctl.cli import app
from tests.engine.test_catalog_search import greedy_reference, reference
from tests.support.checkpoints import load_hf
from tests.support.cli import grctl
from tests.support.onerec import (
    expand_vocab,
    expand_with_openonerec,
    sid_tokens,
    spread_sid_rows,
    write_base,
)

pytestmark = pytest.mark.timeout(300)

LEVELS, CODES = 3, 8
REASONING = "user watched a, b<think>likes b</think>"
FORCED = "\n<|sid_begin|>"


def sid_table(num: int, seed: int = 5) -> list[tuple[int, list[int]]]:
    """(pid, codes) rows; the last two pids share the first's SID (a collision)."""
    rng = random.Random(seed)
    rows = [(1000 + i, [rng.randrange(CODES) for _ in range(LEVELS)]) for i in range(num)]
    return rows + [(2000, rows[0][1]), (2001, rows[0][1])]


def sid_text(codes: list[int]) -> str:
    return (
        "<|sid_begin|>"
        + "".join(f"<s_{'abc'[d]}_{c}>" for d, c in enumerate(codes))
        + ("<|sid_end|>")
    )


def from_sids(table: Path, model: Path, out: Path, *extra: str, process: bool = False) -> dict:
    """`grctl catalog from-sids ... --json`'s document; process: as a real process."""
    argv = ["catalog", "from-sids", str(table), "--tokenizer", str(model), "-o", str(out)]
    argv += [*extra, "--json"]
    if process:
        done = grctl(*argv)
        code, stdout = done.returncode, done.stdout
    else:
        result = CliRunner().invoke(app, argv)
        code, stdout = result.exit_code, result.stdout
    doc = json.loads(stdout)
    assert code == (0 if doc["ok"] else 1), stdout
    return doc


@pytest.fixture(scope="module", params=["expanded here", "expand_qwen3_vocab.py"])
def model(request, tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("onerec")
    base = write_base(work / "base", seed=7)
    if request.param == "expanded here":
        expand_vocab(base, work / "expanded", LEVELS, CODES)
    else:
        expand_with_openonerec(base, work / "expanded", LEVELS, CODES, work / "snapshot")
    return spread_sid_rows(work / "expanded", seed=8, first=259)


@pytest.fixture(scope="module")
def catalog(model, tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("sids")
    rows = sid_table(24)
    table = work / "pid2sid.jsonl"
    table.write_text("".join(json.dumps({"pid": p, "sid": sid_text(c)}) + "\n" for p, c in rows))
    report = from_sids(table, model, work / "catalog.jsonl", process=True)
    return {"rows": rows, "path": work / "catalog.jsonl", "report": report}


def test_both_expansions_give_openonerecs_vocabulary(model):
    tok = transformers.AutoTokenizer.from_pretrained(model)
    vocab = tok.get_vocab()
    added = sid_tokens(LEVELS, CODES)
    ids = [vocab[t] for t in added]
    assert ids == list(range(259, 259 + len(added)))  # appended after the base's, in order
    config = json.loads((model / "config.json").read_text())
    assert config["vocab_size"] == 512 == load_hf(model).lm_head.weight.shape[0]
    assert tok.convert_ids_to_tokens(tok.encode(FORCED + "<s_a_3><s_b_7><s_c_0><|sid_end|>")) == [
        "Ċ", "<|sid_begin|>", "<s_a_3>", "<s_b_7>", "<s_c_0>", "<|sid_end|>"
    ]  # fmt: skip
    assert tok.encode("</think>") == [vocab["</think>"]]


def test_from_sids_builds_the_catalog_through_the_tokenizer(catalog, model):
    tok = transformers.AutoTokenizer.from_pretrained(model)
    report = catalog["report"]
    assert report["ok"] and report["num_items"] == 26 and report["num_levels"] == LEVELS
    assert report["max_depth"] == LEVELS + 1 and report["self_delimiting"]
    assert report["num_collision_items"] >= 3 and report["num_items_out_of_range"] == 0
    lines = [json.loads(x) for x in catalog["path"].read_text().splitlines()]
    for line, (pid, codes) in zip(lines, catalog["rows"], strict=True):
        spelled = tok.encode(sid_text(codes))  # the tokenizer's own ids of the SID text
        assert line == {"item_id": pid, "token_ids": spelled[1:]}  # after <|sid_begin|>


def test_parquet_codes_and_begin_token(catalog, model, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pids, codes = zip(*catalog["rows"], strict=True)
    pq.write_table(pa.table({"pid": list(pids), "sid": list(codes)}), tmp_path / "p.parquet")
    report = from_sids(tmp_path / "p.parquet", model, tmp_path / "c.jsonl")
    assert report["ok"] and (tmp_path / "c.jsonl").read_text() == catalog["path"].read_text()
    report = from_sids(tmp_path / "p.parquet", model, tmp_path / "b.jsonl", "--with-begin")
    begin = transformers.AutoTokenizer.from_pretrained(model).convert_tokens_to_ids("<|sid_begin|>")
    first = json.loads((tmp_path / "b.jsonl").read_text().splitlines()[0])
    assert report["max_depth"] == LEVELS + 2 and first["token_ids"][0] == begin


@pytest.mark.parametrize(
    ("rows", "needle"),
    [
        ({"pid": 1, "sid": "<s_a_1><s_b_99><s_c_2>"}, "has no <s_b_99>"),
        ({"pid": 2, "sid": "<s_b_1><s_a_1>"}, "levels must run a, b, c"),
        ({"pid": 3, "sid": "s_a_1"}, "not OpenOneRec's form"),
        ({"pid": 4, "sid": [1, -2]}, "neither OpenOneRec's text nor a list"),
        ({"pid": 5}, "line 1: not an object with `pid` and `sid`"),
    ],
)
def test_from_sids_refuses_a_bad_table_writing_nothing(model, tmp_path, rows, needle):
    table = tmp_path / "t.jsonl"
    table.write_text(json.dumps(rows) + "\n")
    report = from_sids(table, model, tmp_path / "c.jsonl")
    assert not report["ok"] and needle in report["error"], report
    assert not (tmp_path / "c.jsonl").exists()


def test_unexpanded_tokenizer_is_refused(tmp_path):
    base = write_base(tmp_path / "base")
    table = tmp_path / "t.jsonl"
    table.write_text(json.dumps({"pid": 1, "sid": sid_text([1, 2, 3])}) + "\n")
    report = from_sids(table, base, tmp_path / "c.jsonl")
    assert not report["ok"] and "has no <|sid_end|>" in report["error"]


@pytest.fixture(scope="module")
def srv(start_server, model, catalog):
    return start_server("--model-path", str(model), "--catalog", str(catalog["path"]))


@pytest.mark.parametrize("width", [1, 4, 8])
def test_items_after_the_forced_prefix_are_whole_catalog_items(http, model, catalog, width):
    tok = transformers.AutoTokenizer.from_pretrained(model)
    prompt = tok.encode(REASONING + FORCED)
    assert prompt[-2:] == tok.convert_tokens_to_ids(["Ċ", "<|sid_begin|>"])
    body = {"text": REASONING + FORCED, "sampling_params": {"n": width, "max_new_tokens": 8}}
    reply = http.post("/generate", json=body).json()
    lines = [json.loads(x) for x in catalog["path"].read_text().splitlines()]
    pids: dict[tuple, list] = {}
    for line in lines:
        pids.setdefault(tuple(line["token_ids"]), []).append(line["item_id"])
    end = tok.convert_tokens_to_ids("<|sid_end|>")
    results = reply["meta_info"]["item_results"]
    assert len(results) == width
    for row, beam in zip(results, reply["meta_info"]["beam_results"], strict=True):
        assert row["is_complete"] and beam["output_ids"][-1] == end
        assert row["item_ids"] == pids[tuple(beam["output_ids"])]
        assert beam["meta_info"]["finish_reason"] == {"type": "stop", "item_id": row["item_id"]}
    hf = load_hf(model)
    if width == 1:  # greedy over the allowed children
        want = [greedy_reference(hf, prompt, lines, 8)]
    else:
        want = reference(hf, prompt, lines, width, 8, pad_token_id=0, eos_token_id=None)
    got = [(b["output_ids"], b["meta_info"]["sequence_score"]) for b in reply["meta_info"][
        "beam_results"]]  # fmt: skip
    assert [g for g, _ in got] == [w for w, _ in want]
    assert [s for _, s in got] == pytest.approx([s for _, s in want], abs=1e-4)


def test_think_closes_the_reasoning_as_a_stop_string(http, model):
    """Free sampling (no catalog) with `</think>` as the stop string ends on that token, where
    transformers' greedy run with the same bias on it first emits it."""
    tok = transformers.AutoTokenizer.from_pretrained(model)
    think = tok.convert_tokens_to_ids("</think>")
    prompt = tok.encode("user watched a, b<think>")
    hf = load_hf(model)
    grid = [0.05 * k for k in range(1, 60)]
    outs = [hf_with_bias(hf, prompt, think, b, 12) for b in grid]
    first = [out.index(think) if think in out else -1 for out in outs]
    # a bias in the middle of three that end it at the same step (2 or later): no near tie
    middle = [k for k in range(1, len(grid) - 1) if first[k - 1] == first[k] == first[k + 1] >= 2]
    assert middle, f"no bias makes the tiny model close its reasoning: {first}"
    bias, out = grid[middle[0]], outs[middle[0]]
    sampling = {"max_new_tokens": 12, "stop": "</think>", "use_catalog": False}
    body = {
        "input_ids": prompt,
        "sampling_params": sampling,
        "logits_processors": [{"type": "token_bias", "token_bias": {str(think): bias}}],
    }
    reply = http.post("/generate", json=body).json()
    assert reply["output_ids"] == out[: out.index(think) + 1]
    assert reply["meta_info"]["finish_reason"] == {"type": "stop", "matched": "</think>"}


def hf_with_bias(hf, prompt: list[int], token: int, bias: float, steps: int) -> list[int]:
    import torch

    class Bias(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores = torch.log_softmax(scores, -1)
            scores[:, token] += bias
            return scores

    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps,
                      do_sample=False, eos_token_id=None, pad_token_id=0,
                      logits_processor=transformers.LogitsProcessorList([Bias()]))  # fmt: skip
    return out[0, len(prompt) :].tolist()


def test_reason_then_recommend_in_one_request(http, model, catalog):
    """One multi-stage request: reasonings sampled until `</think>`, the forced
    `\\n<|sid_begin|>`, then beams over the SID catalog: every beam's response is its group's
    reasoning, the two forced tokens (no logprob) and a whole item closed by `<|sid_end|>`,
    the beams those transformers' constrained beam search finds after that context."""
    tok = transformers.AutoTokenizer.from_pretrained(model)
    think, end = tok.convert_tokens_to_ids(["</think>", "<|sid_end|>"])
    forced = tok.encode(FORCED)
    prompt = tok.encode("user watched a, b<think>")
    reasoning = {"n": 16, "max_new_tokens": 48, "temperature": 1.0, "seed": 3, "stop": "</think>"}
    sampling = {
        "n": 4,
        "max_new_tokens": 8,
        "reasoning": reasoning,
        "forced_prefix": {"text": FORCED},
    }
    reply = http.post("/generate", json={"input_ids": prompt, "sampling_params": sampling})
    assert reply.status_code == 200, reply.text
    meta = reply.json()["meta_info"]
    lines = [json.loads(x) for x in catalog["path"].read_text().splitlines()]
    paths = {tuple(line["token_ids"]) for line in lines}
    groups = {g["group_id"]: g for g in meta["stage_groups"]}
    assert len(groups) == 16 and len(meta["beam_results"]) == 64
    stopped = 0
    for g in groups.values():
        ids = g["reasoning_ids"]
        assert g["prefix_ids"] == forced
        if g["reasoning_finish_reason"] == "stop":
            stopped += 1
            assert g["reasoning_matched"] == "</think>"
            assert ids[-1] == think and ids.count(think) == 1
        else:
            assert think not in ids and len(ids) == 48
    assert stopped >= 1  # this seed closes some reasonings: the stop string was honoured
    hf = load_hf(model)
    checked = set()
    for beam in meta["beam_results"]:
        m = beam["meta_info"]
        g = groups[m["group_id"]]
        n_r = len(g["reasoning_ids"])
        out = beam["output_ids"]
        assert out[:n_r] == g["reasoning_ids"] and out[n_r : n_r + 2] == forced
        item = out[n_r + 2 :]
        assert tuple(item) in paths and item[-1] == end
        assert m["behaviour_logprobs"][n_r : n_r + 2] == [None, None]
        assert None not in m["behaviour_logprobs"][:n_r] + m["behaviour_logprobs"][n_r + 2 :]
        if len(checked) < 2 and m["group_id"] not in checked:
            checked.add(m["group_id"])
            context = prompt + g["reasoning_ids"] + forced
            want = reference(hf, context, lines, 4, 8, pad_token_id=0, eos_token_id=None)
            got = [b["output_ids"][n_r + 2 :] for b in meta["beam_results"]
                   if b["meta_info"]["group_id"] == m["group_id"]]  # fmt: skip
            assert got == [w for w, _ in want]
