"""The tensor wire format: buckets, the serializer, SGLang's paths, validation, hostile payloads."""

from __future__ import annotations

import base64
import copyreg
import dataclasses
import gc
import io
import json
import os
import pickle
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from grctl.errors import WeightValidationError
from grctl.weights.wire import cuda, encode, rebuilds, unpickler
from grctl.weights.wire.decode import decode_bucket, decode_payload
from grctl.weights.wire.encode import (
    FlattenedTensorBucket,
    MultiprocessingSerializer,
    encode_bucket,
    encode_named_tensors,
    share_for_ipc,
)
from grctl.weights.wire.records import FlattenedTensorMetadata, LocalSerializedTensor
from tests.support import hostile_pickles as h

REPO = Path(__file__).resolve().parents[2]


def make_tensors(seed: int, device: str = "cpu") -> list[tuple[str, torch.Tensor]]:
    """Mixed dtypes; the 7-byte tensor leaves the ones after it unaligned in a bucket."""
    g = torch.Generator().manual_seed(seed)
    named = [
        ("model.embed_tokens.weight", torch.randn(256, 64, generator=g)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(64, 64, generator=g).bfloat16()),
        ("model.norm.weight", torch.randn(64, generator=g).half()),
        ("odd", torch.randint(0, 255, (7,), dtype=torch.uint8, generator=g)),
        ("model.layers.0.mlp.down_proj.weight", torch.randn(8, 96, generator=g)),
        ("flag", torch.tensor([True, False, True])),
        ("scalar", torch.tensor(3.5, dtype=torch.float64)),
        ("empty", torch.empty(0, 4)),
    ]
    return [(name, t.to(device)) for name, t in named]


def assert_same(got, expected) -> None:
    assert [n for n, _ in got] == [n for n, _ in expected]
    for (_, a), (_, b) in zip(got, expected, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


# ---- buckets ---------------------------------------------------------------------------------


def test_bucket_uses_byte_offsets_and_round_trips_mixed_dtypes():
    named = make_tensors(0)
    bucket = FlattenedTensorBucket(named_tensors=named)
    flat, meta = bucket.get_flattened_tensor(), bucket.get_metadata()
    assert flat.dtype == torch.uint8 and flat.dim() == 1
    assert (meta[1].start_idx, meta[1].end_idx, meta[1].numel) == (65536, 65536 + 8192, 8192)
    assert meta[4].start_idx == 65536 + 8192 + 128 + 7  # no padding, so not 4-byte aligned
    assert meta[-1].numel == 0 and meta[-1].end_idx == flat.numel()
    assert_same(bucket.reconstruct_tensors(), named)
    first = bucket.reconstruct_tensors()[0][1]
    assert first.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()  # a view


def test_bucket_from_parts_and_empty_bucket():
    named = make_tensors(1)
    built = FlattenedTensorBucket(named_tensors=named)
    again = FlattenedTensorBucket(
        flattened_tensor=built.get_flattened_tensor(), metadata=built.get_metadata()
    )
    assert_same(again.reconstruct_tensors(), named)
    empty = FlattenedTensorBucket(named_tensors=[])
    assert empty.get_flattened_tensor().numel() == 0 and empty.get_metadata() == []
    assert empty.reconstruct_tensors() == []
    slime_padding = {"flattened_tensor": torch.empty(0, dtype=torch.uint8), "metadata": []}
    assert decode_bucket(slime_padding) == []
    assert decode_payload(encode_bucket([]), "flattened_bucket") == []
    with pytest.raises(ValueError):
        FlattenedTensorBucket()


def test_old_layout_bucket_counts_elements():
    a, b = torch.randn(2, 3), torch.randn(5)
    flat = torch.cat([a.flatten(), b.flatten()])  # float32, indices in elements (PR #8079 era)
    meta = [
        FlattenedTensorMetadata("a", torch.Size([2, 3]), torch.float32, 0, 6, 6),
        FlattenedTensorMetadata("b", torch.Size([5]), torch.float32, 6, 11, 5),
    ]
    payload = MultiprocessingSerializer.serialize({"flattened_tensor": flat, "metadata": meta})
    assert_same(decode_payload(payload, "flattened_bucket"), [("a", a), ("b", b)])
    as_objects = [types.SimpleNamespace(**vars(m)) for m in meta]  # any object with the fields
    assert_same(
        decode_bucket({"flattened_tensor": flat, "metadata": as_objects}), [("a", a), ("b", b)]
    )
    as_objects[1].dtype = torch.bfloat16
    with pytest.raises(WeightValidationError, match="'b'.*old-layout"):
        decode_bucket({"flattened_tensor": flat, "metadata": as_objects})


def _two_records() -> tuple[torch.Tensor, list[types.SimpleNamespace]]:
    w, b = torch.randn(2, 4), torch.randn(4).bfloat16()  # 32 bytes at [0, 32), 8 at [32, 40)
    bucket = FlattenedTensorBucket(named_tensors=[("w", w), ("b", b)])
    records = [types.SimpleNamespace(**vars(m)) for m in bucket.get_metadata()]
    return bucket.get_flattened_tensor(), records


BAD_RECORDS = {
    "end past the flat tensor": ("b", dict(end_idx=48, numel=16), "outside"),
    "start after end": ("b", dict(start_idx=36, end_idx=32, numel=-4), "outside"),
    "negative start": ("w", dict(start_idx=-8, end_idx=24), "outside"),
    "overlapping": ("b", dict(start_idx=28, end_idx=36), "overlap"),
    "negative dim": ("w", dict(shape=(2, -4)), "shape"),
    "shape not a sequence": ("w", dict(shape=8), "shape"),
    "numel is not end - start": ("w", dict(numel=16), "numel"),
    "bytes do not match shape": ("w", dict(shape=(2, 2)), "does not match shape"),
    "dtype as a string": ("b", dict(dtype="bfloat16"), "dtype"),
    "dtype missing": ("b", dict(dtype=None), "dtype"),
    "quantized dtype": ("b", dict(dtype=torch.qint8), "qint8"),
    "float offset": ("w", dict(start_idx=0.0), "start_idx"),
    "bool numel": ("b", dict(numel=True), "numel"),
    "name not a str": ("w", dict(name=5), "record 0|record: name 5"),
    "name as bytes": ("b", dict(name=b"b"), "record 1|record: name b"),
}


@pytest.mark.parametrize("case", list(BAD_RECORDS))
def test_bucket_validation_names_tensor_and_fault(case):
    flat, records = _two_records()
    target, changes, fault = BAD_RECORDS[case]
    record = next(r for r in records if r.name == target)
    vars(record).update(changes)
    with pytest.raises(WeightValidationError, match=fault) as err:
        decode_bucket({"flattened_tensor": flat, "metadata": records})
    assert isinstance(record.name, (int, bytes)) or f"'{target}'" in str(err.value)
    # and the same refusal when the bucket arrives pickled, as our own records
    pickled = [FlattenedTensorMetadata(**vars(r)) for r in records]
    payload = MultiprocessingSerializer.serialize({"flattened_tensor": flat, "metadata": pickled})
    with pytest.raises(WeightValidationError, match=fault):
        decode_payload(payload, "flattened_bucket")


@pytest.mark.parametrize(
    "obj",
    [
        [],
        {"metadata": []},
        {"flattened_tensor": [1, 2], "metadata": []},
        {"flattened_tensor": torch.zeros(2, 2, dtype=torch.uint8), "metadata": []},
        {"flattened_tensor": torch.zeros(4, dtype=torch.uint8), "metadata": {"w": 1}},
    ],
)
def test_bucket_shape_is_checked(obj):
    with pytest.raises(WeightValidationError):
        decode_bucket(obj)


# ---- serializer and payload entries ------------------------------------------------------------


def test_entries_may_be_base64_text_base64_bytes_or_raw_pickle():
    named = make_tensors(2)[:3]
    raw = MultiprocessingSerializer.serialize(named)
    assert isinstance(raw, bytes) and raw[:2] == b"\x80\x04"
    text = base64.b64encode(raw).decode()
    for entry in (raw, text, text.encode()):
        assert_same(decode_payload(entry, "direct"), named)
    assert MultiprocessingSerializer.serialize(named, output_str=True).isascii()


@pytest.mark.parametrize(
    "entry",
    [
        "not base64!",
        base64.b64encode(pickle.dumps([])).decode() + "\n",  # validate=True: no whitespace
        b"\x00\x01garbage",
        b"\x80\x09not a protocol",
        12345,
        pickle.dumps([("w", list(range(50)))], protocol=4)[:-9],  # truncated
        base64.b64encode(pickle.dumps([("w", list(range(50)))], protocol=4)[:40]).decode(),
    ],
)
def test_bad_entries_are_refused(entry):
    with pytest.raises(WeightValidationError):
        decode_payload(entry, None)


def test_unknown_load_format_names_accepted_ones():
    entry = MultiprocessingSerializer.serialize([], output_str=True)
    with pytest.raises(WeightValidationError, match="flattened_bucket, direct or null"):
        decode_payload(entry, "verl.workers.loader.DeltaLoader")


@pytest.mark.parametrize(
    "obj, fault",
    [
        ({"w": torch.zeros(2)}, "list of"),
        ([("w",)], "pair"),
        ([(1, torch.zeros(2))], "name"),
        ([("w", torch.Size([2]))], "Size, not a tensor"),
        ([("w", [1.0, 2.0])], "list, not a tensor"),
    ],
)
def test_direct_payload_is_checked(obj, fault):
    with pytest.raises(WeightValidationError, match=fault):
        decode_payload(MultiprocessingSerializer.serialize(obj, output_str=True), "direct")


def test_cpu_tensors_travel_by_shared_memory_name():
    before = torch.multiprocessing.get_sharing_strategy()
    named = make_tensors(5)
    entry = encode_bucket(named)
    assert len(entry) < 2000  # 86 KB of tensors; only names and offsets in the body
    assert torch.multiprocessing.get_sharing_strategy() == before  # no global switch
    got = decode_payload(entry, "flattened_bucket")
    assert_same(got, named)
    assert got[0][1].is_shared()


def test_payloads_name_exactly_these_globals():
    seen = set()

    class Recorder(unpickler.SafeUnpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    named = make_tensors(6)
    verl = [(n, LocalSerializedTensor([MultiprocessingSerializer.serialize(t)])) for n, t in named]
    for obj in (FlattenedTensorBucket(named_tensors=named).to_payload(), named, verl):
        loaded = Recorder(io.BytesIO(MultiprocessingSerializer.serialize(obj))).load()
    assert_same([(n, MultiprocessingSerializer.deserialize(v.entry(0))) for n, v in loaded], named)
    red = "torch.multiprocessing.reductions"
    wire = {
        (red, "rebuild_tensor"),
        (red, "rebuild_typed_storage"),
        (red, "rebuild_storage_filename"),
    }
    wire |= {("torch", "Tensor"), ("torch.storage", "UntypedStorage"), ("torch", "Size")}
    wire |= {
        ("grctl.weights.wire.records", "FlattenedTensorMetadata"),
        ("grctl.weights.wire.records", "LocalSerializedTensor"),
    }
    dtypes = {("torch", str(t.dtype).removeprefix("torch.")) for _, t in named}
    assert seen == wire | dtypes


# ---- SGLang's and verl's class paths -------------------------------------------------------


def _sglang_metadata_class() -> type:  # SGLang's FlattenedTensorMetadata, field for field
    fields = ["name", "shape", "dtype", "start_idx", "end_idx", "numel"]
    return dataclasses.make_dataclass("FlattenedTensorMetadata", fields)


def _sglang_local_serialized_tensor_class() -> type:
    return dataclasses.make_dataclass("LocalSerializedTensor", ["values"])


def _sglang_rebuild_function():
    def _rebuild_cuda_tensor_modified(*args):  # pickled by reference only, never called
        raise AssertionError("called")

    return _rebuild_cuda_tensor_modified


class _CudaRecord:
    """Pickles the way an IPC'd CUDA tensor does: one rebuild call with 15 arguments."""

    def __init__(self, rebuild, device, size=(0,), nbytes=0):
        self.rebuild, self.device, self.size, self.nbytes = rebuild, device, size, nbytes

    def __reduce__(self):
        handle = None if self.nbytes == 0 else b"\x01" * 64
        storage = torch.storage.TypedStorage
        args = (torch.Tensor, torch.Size(self.size), (1,), 0, storage, torch.uint8, self.device)
        return self.rebuild, (*args, handle, self.nbytes, 0, False, None, 0, None, False)


def _pickle_as(module: str, obj, payload, monkeypatch) -> str:
    """Serialize `payload` while `obj` poses as module.<its name>; the modules are gone after."""
    obj.__module__, obj.__qualname__ = module, obj.__name__
    with monkeypatch.context() as patch:
        parts = module.split(".")
        for n in range(1, len(parts) + 1):
            patch.setitem(sys.modules, ".".join(parts[:n]), types.ModuleType(".".join(parts[:n])))
        setattr(sys.modules[module], obj.__name__, obj)
        entry = MultiprocessingSerializer.serialize(payload, output_str=True)
    assert module not in sys.modules and "sglang" not in sys.modules
    return entry


@pytest.mark.parametrize(
    "module", ["sglang.srt.weight_sync.tensor_bucket", "sglang.srt.model_executor.model_runner"]
)
def test_sglang_metadata_path_decodes_to_ours(module, monkeypatch):
    named = make_tensors(7)
    bucket = FlattenedTensorBucket(named_tensors=named)
    cls = _sglang_metadata_class()
    records = [cls(**vars(m)) for m in bucket.get_metadata()]
    obj = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": records}
    entry = _pickle_as(module, cls, obj, monkeypatch)
    assert module.encode() in base64.b64decode(entry)
    decoded = MultiprocessingSerializer.deserialize(entry)
    assert all(type(r) is FlattenedTensorMetadata for r in decoded["metadata"])
    assert_same(decode_payload(entry, "flattened_bucket"), named)
    assert module not in sys.modules  # decoding imported nothing


@pytest.mark.parametrize(
    "module",
    [
        "sglang.srt.model_executor.model_runner",
        "sglang.srt.model_executor.model_runner_components.weight_updater",
    ],
)
def test_verl_local_serialized_tensors_decode(module, monkeypatch):
    named = make_tensors(8)
    cls = _sglang_local_serialized_tensor_class()
    inner = [(n, cls([MultiprocessingSerializer.serialize(t)])) for n, t in named]
    entry = _pickle_as(module, cls, inner, monkeypatch)
    got = decode_payload(entry, None)
    assert_same(got, named)
    lst = MultiprocessingSerializer.deserialize(entry)[0][1]
    assert type(lst) is LocalSerializedTensor
    with pytest.raises(WeightValidationError, match="TP rank 1"):
        lst.entry(1)


@pytest.mark.parametrize("module", ["grctl.weights.wire_records", "grctl.weights.ipc"])
def test_older_grctl_record_paths_decode(module, monkeypatch):
    """Clients of an older grctl pickle both records under the module paths they had then."""
    named = make_tensors(9)
    bucket = FlattenedTensorBucket(named_tensors=named)
    cls = _sglang_metadata_class()
    records = [cls(**vars(m)) for m in bucket.get_metadata()]
    obj = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": records}
    entry = _pickle_as(module, cls, obj, monkeypatch)
    assert module.encode() in base64.b64decode(entry)
    assert_same(decode_payload(entry, "flattened_bucket"), named)
    wrapper = _sglang_local_serialized_tensor_class()
    inner = [(n, wrapper([MultiprocessingSerializer.serialize(t)])) for n, t in named]
    entry = _pickle_as(module, wrapper, inner, monkeypatch)
    assert module.encode() in base64.b64decode(entry)
    assert_same(decode_payload(entry, None), named)


@pytest.mark.parametrize(
    "module", ["sglang.srt.utils.patch_torch", "sglang.srt.patch_torch", "torch_stock"]
)
def test_slime_empty_cuda_padding_bucket(module, monkeypatch):
    """slime pads with {"flattened_tensor": <0-byte CUDA tensor>, "metadata": []}."""
    device = cuda.cuda_device_uuid(0) if torch.cuda.is_available() else "GPU-1234-abcd"
    if module == "torch_stock":  # unpatched senders name torch's function and send an index
        record = _CudaRecord(torch.multiprocessing.reductions.rebuild_cuda_tensor, 0)
        obj = {"flattened_tensor": record, "metadata": []}
        entry = MultiprocessingSerializer.serialize(obj, output_str=True)
    else:
        rebuild = _sglang_rebuild_function()
        obj = {"flattened_tensor": _CudaRecord(rebuild, device), "metadata": []}
        entry = _pickle_as(module, rebuild, obj, monkeypatch)
    assert decode_payload(entry, "flattened_bucket") == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_cuda_payload_without_cuda_is_refused():
    rebuild = torch.multiprocessing.reductions.rebuild_cuda_tensor
    obj = {"flattened_tensor": _CudaRecord(rebuild, 0, size=(64,), nbytes=64), "metadata": []}
    with pytest.raises(WeightValidationError, match="no CUDA device"):
        decode_payload(MultiprocessingSerializer.serialize(obj), "flattened_bucket")


def test_device_uuid_maps_to_local_index(monkeypatch):
    uuids = ["GPU-aaaa", "GPU-bbbb"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid=uuids[i])
    )
    assert rebuilds.cuda_device_index("GPU-bbbb") == 1
    assert rebuilds.cuda_device_index(0) == 0
    with pytest.raises(WeightValidationError, match="UUID 'GPU-cccc'"):
        rebuilds.cuda_device_index("GPU-cccc")
    with pytest.raises(WeightValidationError, match="device 2"):
        rebuilds.cuda_device_index(2)


def test_sender_puts_device_uuid_at_arg_6(monkeypatch):
    """The reducer swap itself, on CPU: torch's CUDA reducer is faked, the UUID lookup too."""
    red = torch.multiprocessing.reductions
    fake_args = tuple(range(15))
    monkeypatch.setattr(red, "reduce_tensor", lambda t: (red.rebuild_cuda_tensor, fake_args))
    monkeypatch.setattr(encode, "cuda_device_uuid", lambda index: f"GPU-{index}")
    rebuild, args = encode._reduce_tensor(torch.zeros(1))
    assert rebuild is red.rebuild_cuda_tensor and len(args) == 15
    assert args[6] == "GPU-6" and args[:6] + args[7:] == fake_args[:6] + fake_args[7:]


# ---- across a real process boundary ------------------------------------------------------------


def _sender_main() -> None:
    """Child: serialize tensors from a seed, print the entries, hold them until told to exit."""
    seed, device = int(sys.argv[1]), sys.argv[2]
    named, keep = make_tensors(seed, device), []
    verl = [(n, LocalSerializedTensor([MultiprocessingSerializer.serialize(t)])) for n, t in named]
    entries = {
        "pid": os.getpid(),
        "bucket": encode_bucket(named, keep),
        "direct": encode_named_tensors(named, keep),
        "verl": MultiprocessingSerializer.serialize(verl, output_str=True),
        "empty": MultiprocessingSerializer.serialize(
            {"flattened_tensor": torch.empty(0, dtype=torch.uint8, device=device), "metadata": []},
            output_str=True,
        ),
    }
    if device == "cuda":
        entries["sglang"] = _serialize_like_patched_sglang(named)
        entries["past_block"] = _serialize_past_its_block(named[0][1])
    print(json.dumps(entries), flush=True)
    sys.stdin.readline()
    del named, keep, verl, entries
    gc.collect()


def _serialize_like_patched_sglang(named) -> str:
    """CUDA tensors pickled as SGLang's patched reducer does: its rebuild path, UUID at arg 6."""
    module = "sglang.srt.utils.patch_torch"
    rebuild = _sglang_rebuild_function()
    rebuild.__module__, rebuild.__qualname__ = module, rebuild.__name__
    parts = module.split(".")
    for n in range(1, len(parts) + 1):
        sys.modules[".".join(parts[:n])] = types.ModuleType(".".join(parts[:n]))
    setattr(sys.modules[module], rebuild.__name__, rebuild)
    buf = io.BytesIO()
    pickler = encode._IpcPickler(buf)
    pickler.dispatch_table[torch.Tensor] = lambda t: (rebuild, encode._reduce_tensor(t)[1])
    pickler.dump(named)
    return base64.b64encode(buf.getvalue()).decode()


def _serialize_past_its_block(tensor: torch.Tensor) -> str:
    """A CUDA record whose storage claims 1 GiB more than the IPC block it names holds."""

    def reduce(t: torch.Tensor):
        rebuild, args = encode._reduce_tensor(t)
        return rebuild, (*args[:8], args[8] + (1 << 30), *args[9:])  # storage_size_bytes

    buf = io.BytesIO()
    pickler = encode._IpcPickler(buf)
    pickler.dispatch_table[torch.Tensor] = reduce
    pickler.dump([("w", tensor)])
    return base64.b64encode(buf.getvalue()).decode()


def _torch_segments(pid: int) -> list[str]:
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith(f"torch_{pid}_"))


def _round_trip_across_processes(device: str) -> None:
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from tests.weights.test_ipc import _sender_main; _sender_main()",
            "11",
            device,
        ],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        entries = json.loads(child.stdout.readline())
        expected = make_tensors(11, device)
        formats = {"bucket": "flattened_bucket", "direct": "direct", "verl": None}
        if device == "cuda":
            formats["sglang"] = None
        for key, load_format in formats.items():
            got = decode_payload(entries[key], load_format)
            assert_same(got, expected)
            assert all(t.device.type == device for _, t in got)
            del got
        assert decode_payload(entries["empty"], "flattened_bucket") == []
        if device == "cuda":
            raw = base64.b64decode(entries["bucket"])
            assert cuda.cuda_device_uuid(0).encode() in raw  # arg 6 is the UUID
            torch.cuda.synchronize()
            with pytest.raises(WeightValidationError, match="past its IPC block"):
                decode_payload(entries["past_block"], None)  # last: torch caches by handle
    finally:
        gc.collect()
        child.communicate("exit\n", timeout=60)
    assert child.returncode == 0
    if device == "cpu" and os.path.isdir("/dev/shm"):
        deadline = time.monotonic() + 5
        while _torch_segments(entries["pid"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _torch_segments(entries["pid"]) == []  # nothing leaked in /dev/shm


def test_cpu_round_trip_across_processes():
    _round_trip_across_processes("cpu")


@pytest.mark.gpu
def test_cuda_ipc_round_trip_across_processes_with_device_uuid():
    _round_trip_across_processes("cuda")


def test_shared_memory_records_are_checked_against_the_segment():
    tensor = share_for_ipc(torch.zeros(4))
    manager, handle, size = tensor.untyped_storage()._share_filename_cpu_()
    rebuild = h.glob(h.RED, "rebuild_storage_filename")

    def entry(handle: bytes, size: int) -> bytes:
        return h.done(h.call(rebuild, h.UNTYPED, h.b(manager), h.b(handle), h.i(size)))

    with pytest.raises(WeightValidationError, match="smaller than"):
        MultiprocessingSerializer.deserialize(entry(handle, size + 4096))
    with pytest.raises(WeightValidationError, match="not in this server's /dev/shm") as gone:
        MultiprocessingSerializer.deserialize(entry(b"/torch_1_1_1", size))
    assert "--transport disk" in str(gone.value)  # the message says what to do
    tensor.untyped_storage()._shared_incref()  # as a sender does; the rebuild decrefs
    assert MultiprocessingSerializer.deserialize(entry(handle, size)).nbytes() == size


def test_shared_memory_size_counts_torchs_header():
    """torch maps a segment as a 64-byte header plus `size` bytes and grows a shorter file to
    fit: a size that only fits by eating the header must be refused, before torch grows
    another process's segment."""
    tensor = share_for_ipc(torch.zeros(4))
    manager, handle, size = tensor.untyped_storage()._share_filename_cpu_()
    path = "/dev/shm" + handle.decode()
    before = os.stat(path).st_size
    rebuild = h.glob(h.RED, "rebuild_storage_filename")
    entry = h.done(h.call(rebuild, h.UNTYPED, h.b(manager), h.b(handle), h.i(size + 32)))
    with pytest.raises(WeightValidationError, match="smaller than"):
        MultiprocessingSerializer.deserialize(entry)
    assert os.stat(path).st_size == before


@pytest.mark.parametrize(
    "state, fault",
    [
        (b"(\x88NNt", "autograd"),  # Tensor.__setstate__: requires_grad=True
        (b"(h\x00K\x00(K\x40t(K\x01tt", "resizable|ends at byte"),  # set_ past the end
    ],
)
def test_build_on_a_rebuilt_tensor_is_caught(state, fault, monkeypatch):
    """BUILD would reach Tensor.__setstate__ on a rebuilt tensor: the scan refuses BUILD on
    anything but a wire record, and were it ever to miss one, the decoded tensor is checked
    again."""
    tensor = share_for_ipc(torch.zeros(4))
    manager, handle, size = tensor.untyped_storage()._share_filename_cpu_()
    untyped = h.call(
        h.glob(h.RED, "rebuild_storage_filename"), h.UNTYPED, h.b(manager), h.b(handle), h.i(size)
    )
    typed = h.call(
        h.glob(h.RED, "rebuild_typed_storage"), untyped + b"q\x00", h.glob("torch", "float32")
    )
    meta = b"(K\x00" + h.call(h.glob("torch", "Size"), b"(K\x04t") + b"(K\x01t\x89t"
    rebuilt = h.call(h.glob(h.RED, "rebuild_tensor"), h.glob("torch", "Tensor"), typed, meta)
    payload = h.done(b"](" + h.s("w") + rebuilt + state + b"b\x86e")
    with pytest.raises(WeightValidationError, match="BUILD on what an allowlisted function"):
        decode_payload(payload, "direct")
    tensor.untyped_storage()._shared_incref()  # as a sender does; the rebuild below decrefs
    monkeypatch.setattr(unpickler, "check_stream", lambda data, resolve: None)
    with pytest.raises(WeightValidationError, match=fault):
        decode_payload(payload, "direct")


# ---- hostile payloads ------------------------------------------------------------------------


def test_hostile_builders_really_run_under_plain_pickle(tmp_path):
    """Proves the payloads below are live, so refusing them means something."""
    ran = h.run_unsafely(h.LIVE, tmp_path)
    assert [name for name, made in ran.items() if not made] == []


@pytest.fixture
def hostile_marker(tmp_path, monkeypatch):
    marker = tmp_path / "marker"
    monkeypatch.syspath_prepend(str(tmp_path))  # so an importing find_class would fire
    return marker


@pytest.mark.parametrize("name", sorted(h.HOSTILE))
def test_hostile_payload_is_refused_and_runs_nothing(name, hostile_marker):
    payload = h.HOSTILE[name](hostile_marker)
    copyreg.add_extension("posix", "system", h.EXT_CODE)  # after building: EXT1 must still fail
    try:
        for load_format in ("flattened_bucket", "direct", None):
            with pytest.raises(WeightValidationError):  # protocol 0 is not raw: bad base64
                decode_payload(payload, load_format)
            with pytest.raises(WeightValidationError, match="refused"):
                decode_payload(base64.b64encode(payload).decode(), load_format)
    finally:
        copyreg.remove_extension("posix", "system", h.EXT_CODE)
    time.sleep(0.05)  # a spawned process would have touched it by now
    assert not hostile_marker.exists()
    assert not any(m.startswith("grctl_hostile_") for m in sys.modules)


@pytest.mark.parametrize("name", sorted(h.MISUSE))
def test_allowed_globals_refuse_misuse(name):
    with pytest.raises(WeightValidationError):
        decode_payload(base64.b64encode(h.MISUSE[name]).decode(), "flattened_bucket")


def test_allowlist_never_imports_the_code_that_uses_it():
    """The wire records are data of their own: the unpickler (and its allowlist) loads
    without grctl.weights.wire.encode or .decode, so no module imports back the ones using it."""
    code = (
        "import sys, grctl.weights.wire.unpickler as u; u.SafeUnpickler.find_class(None, "
        "'sglang.srt.weight_sync.tensor_bucket', 'FlattenedTensorMetadata'); "
        "print(any(m in sys.modules for m in ('grctl.weights.wire.encode', "
        "'grctl.weights.wire.decode')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
