"""The weight sink: checkpoint formats, header validation, mapping, in-place copies."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from grctl.errors import WeightValidationError
from grctl.model.config import ModelConfig
from grctl.weights import apply
from grctl.weights.apply import WeightCopyError
from grctl.weights.checkpoint import Checkpoint
from grctl.weights.loader import empty_model, load_checkpoint_into, load_model
from grctl.weights.mapping import resolve
from grctl.weights.views import hf_state_dict, hf_view
from tests.support.checkpoints import load_hf, make_hf_model, write_checkpoint


def snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_unchanged(model, snap) -> None:
    for n, p in model.named_parameters():
        assert torch.equal(p, snap[n]), f"{n} changed"


def assert_matches_checkpoint(model, path) -> None:
    """Every HF tensor of the checkpoint equals the live view of it, bit for bit."""
    ref = make_reference_tensors(path)
    views = hf_state_dict(model)
    for name, t in ref.items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        assert torch.equal(views[name], t.to(views[name].dtype)), name


def make_reference_tensors(path) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in load_hf(path).state_dict().items()}


@pytest.mark.parametrize("layout", ["single", "sharded", "bin", "pt"])
@pytest.mark.parametrize("tied", [False, True])
def test_round_trip_each_format(tmp_path, layout, tied):
    src = write_checkpoint(
        tmp_path / "ckpt",
        seed=3,
        tie_word_embeddings=tied,
        max_shard_size="30KB" if layout == "sharded" else None,
        safe_serialization=layout in ("single", "sharded"),
    )
    if layout == "sharded":
        assert (src / "model.safetensors.index.json").is_file()
    if layout == "pt":
        (src / "pytorch_model.bin").rename(src / "weights.pt")
    model = load_model(src)
    hf = load_hf(tmp_path / "ckpt") if layout != "pt" else None
    ids = torch.randint(0, 128, (2, 19), generator=torch.Generator().manual_seed(0))
    if hf is not None:
        assert (hf(ids).logits - model(ids)[0]).abs().max() < 1e-4
        assert_matches_checkpoint(model, src)
    else:
        state = torch.load(src / "weights.pt", weights_only=True)
        views = hf_state_dict(model)
        for name, t in state.items():
            if name in views:
                assert torch.equal(views[name], t)


def test_load_keeps_storage_in_place(tmp_path):
    write_checkpoint(tmp_path / "a", seed=1)
    write_checkpoint(tmp_path / "b", seed=2, max_shard_size="30KB")
    model = load_model(tmp_path / "a")
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    with Checkpoint(tmp_path / "b") as ckpt:
        n = load_checkpoint_into(model, ckpt)
    assert n == len(ckpt.specs())
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs
    assert_matches_checkpoint(model, tmp_path / "b")


@pytest.fixture
def live(tmp_path):
    write_checkpoint(tmp_path / "base", seed=1)
    model = load_model(tmp_path / "base")
    return model, snapshot(model)


def _rewrite(src, dst, mutate) -> None:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    mutate(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(
    "case, match",
    [
        ("unknown", "unknown tensor"),
        ("missing", "does not cover"),
        ("shape", "has shape"),
        ("int_dtype", "dtype"),
        ("structure", "structure does not match"),
        ("truncated", "unreadable safetensors"),
        ("no_config", "no config.json"),
        ("nonexistent", "does not exist"),
        ("not_dir", "not a directory"),
        ("no_weights", "no weights"),
        ("bad_index", "missing"),
    ],
)
def test_every_refusal_leaves_weights_bit_identical(tmp_path, live, case, match):
    model, snap = live
    base, bad = tmp_path / "base", tmp_path / "bad"
    name = "model.layers.1.mlp.up_proj.weight"
    if case == "unknown":
        _rewrite(
            base, bad, lambda t: t.__setitem__("model.layers.9.mlp.up_proj.weight", t[name].clone())
        )
    elif case == "missing":
        _rewrite(base, bad, lambda t: t.pop("model.layers.1.self_attn.v_proj.weight"))
    elif case == "shape":
        _rewrite(base, bad, lambda t: t.__setitem__(name, t[name][:-1].clone()))
    elif case == "int_dtype":
        _rewrite(base, bad, lambda t: t.__setitem__(name, t[name].to(torch.int32)))
    elif case == "structure":
        write_checkpoint(bad, seed=5, intermediate_size=80)
    elif case == "truncated":
        shutil.copytree(base, bad)
        f = bad / "model.safetensors"
        data = f.read_bytes()
        f.write_bytes(data[: len(data) - 64])
    elif case == "no_config":
        shutil.copytree(base, bad)
        (bad / "config.json").unlink()
    elif case == "nonexistent":
        pass
    elif case == "not_dir":
        bad.write_text("x")
    elif case == "no_weights":
        bad.mkdir()
        shutil.copy(base / "config.json", bad / "config.json")
    elif case == "bad_index":
        write_checkpoint(bad, seed=5, max_shard_size="30KB")
        next(bad.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(WeightValidationError, match=match):
        with Checkpoint(bad) as ckpt:
            load_checkpoint_into(model, ckpt)
    assert_unchanged(model, snap)


def test_mapping_dotted_segments():
    cfg = ModelConfig.from_hf(make_hf_model(0).config.to_dict())
    up = resolve("model.layers.3.mlp.up_proj.weight", cfg)
    assert (up.param_name, up.row_start, up.row_end) == (
        "layers.3.mlp.gate_up_proj.weight",
        cfg.intermediate_size,
        2 * cfg.intermediate_size,
    )
    # The trap: `up_proj` is inside `gate_up_proj`; a fused name must pass through whole.
    fused = resolve("layers.3.mlp.gate_up_proj.weight", cfg)
    assert fused.param_name == "layers.3.mlp.gate_up_proj.weight" and not fused.is_shard
    k = resolve("model.layers.0.self_attn.k_proj.weight", cfg)
    assert (k.row_start, k.row_end) == (cfg.q_size, cfg.q_size + cfg.kv_size)
    assert resolve("lm_head.weight", cfg).param_name == "lm_head.weight"
    tied = ModelConfig(**{**cfg.__dict__, "tie_word_embeddings": True})
    assert resolve("lm_head.weight", tied).param_name == "embed_tokens.weight"
    assert resolve("model.layers.0.self_attn.rotary_emb.inv_freq", cfg) is None


def test_chunk_partial_load_and_dtype_conversion(live):
    model, snap = live
    hf = make_hf_model(7)
    sd = {k: v.to(torch.bfloat16) for k, v in hf.state_dict().items()}
    chunk = [(n, sd[n]) for n in ("model.layers.0.self_attn.k_proj.weight", "model.norm.weight")]
    assert apply.load_tensors(model, chunk) == 2
    assert torch.equal(hf_view(model, chunk[0][0]), chunk[0][1].float())
    assert torch.equal(model.norm.weight, chunk[1][1].float())
    q = hf_view(model, "model.layers.0.self_attn.q_proj.weight")
    assert torch.equal(q, snap["layers.0.self_attn.qkv_proj.weight"][: q.shape[0]])
    # Applying the same chunk twice gives the same weights.
    before = snapshot(model)
    apply.load_tensors(model, chunk)
    assert_unchanged(model, before)


def test_chunk_refusals_change_nothing(live):
    model, snap = live
    good = ("model.norm.weight", torch.full_like(model.norm.weight, 3.0))
    cases = [
        [good, ("model.layers.0.mlp.down_proj.weight", torch.zeros(3, 3))],
        [good, ("model.layers.0.mlp.nope.weight", torch.zeros(3))],
        [good, ("model.norm.weight", torch.zeros(model.norm.weight.shape, dtype=torch.int64))],
    ]
    for chunk in cases:
        with pytest.raises(WeightValidationError):
            apply.load_tensors(model, chunk)
        assert_unchanged(model, snap)
    with pytest.raises(WeightValidationError, match="fused parameter name"):
        apply.load_tensors(
            model,
            [("layers.0.mlp.gate_up_proj.weight", snap["layers.0.mlp.gate_up_proj.weight"])],
            allow_fused=False,
        )
    with pytest.raises(WeightValidationError, match="split name"):
        apply.load_tensors(
            model, [("model.layers.0.mlp.up_proj.weight", torch.zeros(1))], allow_split=False
        )
    assert_unchanged(model, snap)


def test_copy_failure_after_start_is_reported(live):
    model, _ = live
    writes = apply.plan(
        model,
        [
            apply.TensorSpec("model.norm.weight", tuple(model.norm.weight.shape), torch.float32),
            apply.TensorSpec(
                "model.embed_tokens.weight", tuple(model.embed_tokens.weight.shape), torch.float32
            ),
        ],
        require_full=False,
    )

    def fetch(name):
        if name == "model.embed_tokens.weight":
            raise OSError("read error")
        return torch.zeros(model.norm.weight.shape)

    with pytest.raises(WeightCopyError, match="after 1 of 2"):
        apply.copy(writes, fetch)


def test_builtin_model_is_fixed_and_exports(tmp_path):
    a, b = load_model(None), load_model(None)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    from grctl.weights.loader import export_hf

    export_hf(a, tmp_path / "exp")
    cfg = json.loads((tmp_path / "exp" / "config.json").read_text())
    assert cfg["model_type"] == "qwen3"
    hf = load_hf(tmp_path / "exp")
    ids = torch.arange(200, 240).unsqueeze(0)
    assert (hf(ids).logits - a(ids)[0]).abs().max() < 1e-4


def test_empty_model_has_requested_dtype():
    cfg = ModelConfig.from_hf(make_hf_model(0).config.to_dict())
    m = empty_model(cfg, torch.device("cpu"), torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())


@pytest.mark.parametrize("lm_head_first", [True, False])
def test_tied_lm_head_never_writes_the_embedding_twice(tmp_path, lm_head_first):
    """A tied model's lm_head is its embedding. A checkpoint that carries both (lm_head sorts
    first in a safetensors file) keeps the embedding, with one write into that storage: two
    parallel reads into one storage would leave a mix of both tensors."""
    src = write_checkpoint(tmp_path / "src", seed=8, tie_word_embeddings=True)
    state = load_file(src / "model.safetensors")
    embed = state["model.embed_tokens.weight"]
    state["lm_head.weight"] = torch.randn_like(embed)
    shutil.copytree(src, tmp_path / "both")
    save_file(state, tmp_path / "both" / "model.safetensors", metadata={"format": "pt"})
    model = load_model(str(src), device="cpu", dtype="float32")
    model.embed_tokens.weight.data.zero_()
    ckpt = Checkpoint(tmp_path / "both")
    specs = sorted(
        ckpt.specs(), key=lambda s: s.name != "lm_head.weight", reverse=not lm_head_first
    )
    writes = apply.plan(model, specs, require_full=True)
    into_embedding = [w.name for w in writes if w.param_name == "embed_tokens.weight"]
    assert into_embedding == ["model.embed_tokens.weight"]
    apply.copy(writes, ckpt.fetch, ckpt.read_into, workers=4)
    assert torch.equal(model.embed_tokens.weight, embed)
