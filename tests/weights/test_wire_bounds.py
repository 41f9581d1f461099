"""What one payload may make the receiver do: bounded work, bounded messages, no allowlisted
object changed, records only through their checks; CUDA IPC bounds and ref counters fail
closed (the CUDA queries stubbed here; the real IPC path in test_ipc's gpu test)."""

from __future__ import annotations

import base64
import io
import os
import subprocess
import sys
import time
import tracemalloc
import types
from pathlib import Path

import pytest
import torch
from torch.multiprocessing import reductions

from grctl.errors import WeightValidationError
from grctl.weights.wire import rebuilds, scan, unpickler
from grctl.weights.wire.decode import decode_payload
from grctl.weights.wire.describe import describe
from grctl.weights.wire.encode import encode_bucket
from grctl.weights.wire.records import LocalSerializedTensor
from grctl.weights.wire.segments import REF_COUNTER_FILE_BYTES
from tests.support import hostile_pickles as h

REPO = Path(__file__).resolve().parents[2]


def refusal(payload: bytes, load_format: str | None = None, within: float = 0.05) -> str:
    """The WeightValidationError message for `payload`, which must come within `within` s."""
    start = time.perf_counter()
    with pytest.raises(WeightValidationError) as err:
        decode_payload(base64.b64encode(payload).decode(), load_format)
    elapsed = time.perf_counter() - start
    assert elapsed < within, f"refused after {elapsed:.3f} s"
    return str(err.value)


# ---- bounded work ------------------------------------------------------------------------------


SHARED_TUPLE_KEY = h.done(b"}" + h.shared_nest(24, empty=b")", close=b"t") + h.i(1) + b"s")


@pytest.mark.parametrize(
    "payload, fault",
    [
        (h.BOUNDS["shared_lists_in_a_message"], "unfold"),  # 2.7 s of repr, before
        (SHARED_TUPLE_KEY, "unfold"),  # 2**24 tuple hashes, before
        (h.BOUNDS["deep_lists"], "deep"),
        (h.BOUNDS["colliding_int_keys"], "dict key"),
        (h.BOUNDS["set_of_items"], "set"),
    ],
    ids=["shared_lists", "shared_tuple_key", "deep_lists", "int_keys", "set"],
)
def test_payloads_that_would_stall_are_refused_at_once(payload, fault):
    message = refusal(payload)
    assert fault in message, message
    assert len(message) < 600


def test_deep_tuple_key_does_not_crash_the_process():
    """Hashing a 200,000-deep tuple (a dict key) overflows the C stack: a segfault, before."""
    code = (
        "import base64; from tests.support import hostile_pickles as h\n"
        "from grctl.weights.wire.decode import decode_payload\n"
        "from grctl.errors import WeightValidationError\n"
        "try:\n"
        "    decode_payload(h.BOUNDS['deep_tuple_as_a_dict_key'], None)\n"
        "except WeightValidationError as exc:\n"
        "    print('refused:', exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert "refused:" in out.stdout and "deep" in out.stdout


def test_memo_index_far_ahead_allocates_nothing():
    tracemalloc.start()
    try:
        with pytest.raises(WeightValidationError, match="memo"):
            decode_payload(h.done(h.memo_put_at(2**22)), None)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, f"peak {peak} bytes"  # the C memo would take 64 MiB


@pytest.mark.parametrize(
    "limit, value, payload, fault",
    [
        ("MAX_OPCODES", 50, h.done(h.lst(*[h.i(n) for n in range(60)])), "opcodes"),
        ("MAX_MEMO", 10, h.done(h.lst(*[h.s(f"n{n}") + b"\x94" for n in range(20)])), "memo"),
        ("MAX_DEPTH", 4, h.done(b"(" * 6 + b"]" + b"l" * 6), "deep"),
        ("MAX_OPCODES_WITHOUT_A_CALL", 40, h.done(h.lst(*[h.i(n) for n in range(60)])), "GIL"),
    ],
)
def test_each_limit_refuses_past_it(monkeypatch, limit, value, payload, fault):
    monkeypatch.setattr(scan, limit, value)
    assert fault in refusal(payload)


def test_legitimate_payloads_stay_well_inside_the_limits():
    """A bucket of 400 tensors unfolds to about what it holds: far from every bound."""
    named = [(f"model.layers.{n}.mlp.down_proj.weight", torch.zeros(4, 4)) for n in range(400)]
    keep: list = []
    raw = base64.b64decode(encode_bucket(named, keep))
    report = scan.check_stream(raw, unpickler.resolve)
    assert report.num_opcodes < scan.MAX_OPCODES // 50
    assert report.max_depth <= 8
    assert report.max_unfolded < 2 * report.num_opcodes
    assert report.max_opcodes_without_a_call < scan.MAX_OPCODES_WITHOUT_A_CALL // 100


def test_the_c_unpickler_is_never_left_running_long():
    """A stream that never calls into Python would hold the GIL through the whole C load
    (80,000 tuples: 0.1 s on a loaded machine, while /health waits): refused, unless calls
    (find_class here) come often enough to let other threads in."""
    items = (h.s("w") + h.i(1) + b"\x86") * 80_000
    assert "GIL" in refusal(h.done(b"](" + items + b"e"), within=5.0)
    call = h.glob("torch", "Size") + b"0"  # STACK_GLOBAL (find_class), POP
    chunk = (h.s("w") + h.i(1) + b"\x86") * 1000
    spaced = h.done(b"](" + (chunk + call) * 80 + b"e")
    report = scan.check_stream(spaced, unpickler.resolve)
    assert report.max_opcodes_without_a_call <= 3005  # a chunk, the POP, the next strings


def test_unpickler_checks_the_stream_itself():
    """SafeUnpickler.load runs the scan too, so no caller can skip it."""
    with pytest.raises(WeightValidationError, match="unfold"):
        unpickler.SafeUnpickler(io.BytesIO(h.BOUNDS["shared_lists_in_a_message"])).load()


# ---- bounded messages, built only on failure ------------------------------------------------


def test_describe_is_bounded():
    nested: list = []
    for _ in range(40):
        nested = [nested, nested]
    for value in (nested, "x" * 10**6, b"y" * 10**6, 7 ** (10**5), tuple(range(10**5)), 2.5):
        assert len(describe(value)) <= 120
    assert describe((4, 1)) == "(4, 1)" and describe("GPU-1") == "'GPU-1'"


def test_passing_checks_format_nothing():
    """A message is formatted only when its check fails: before, every check built its repr."""

    class Loud(str):
        def __repr__(self):
            raise AssertionError("formatted a message for a check that passed")

    args = cuda_record(0, 0)
    args[6] = Loud("GPU-1")
    tensor = rebuilds.rebuild_cuda_tensor(*args)
    assert tensor.numel() == 0


# ---- nothing allowlisted changes; records only through __setstate__ ----------------------------


@pytest.mark.parametrize(
    "name",
    [
        "build_defaults_on_an_allowed_function",
        "build_on_a_class_token",
        "build_on_an_ordered_dict",
        "build_on_a_record_class",
    ],
)
def test_build_only_reaches_the_wire_records(name):
    defaults = rebuilds.rebuild_storage_filename.__defaults__
    try:
        assert "BUILD" in refusal(h.BOUNDS[name])
        assert rebuilds.rebuild_storage_filename.__defaults__ == defaults
        assert rebuilds.TENSOR.name == "torch.Tensor"
    finally:
        rebuilds.rebuild_storage_filename.__defaults__ = defaults  # for the tests after, if not
    named = [("w", torch.arange(4.0))]
    keep: list = []
    got = decode_payload(encode_bucket(named, keep), "flattened_bucket")  # CPU pushes still work
    assert torch.equal(got[0][1], named[0][1])


def test_allowlisted_globals_refuse_build_without_the_scan(monkeypatch):
    """Defence in depth: the objects find_class hands out refuse BUILD themselves."""
    defaults = rebuilds.rebuild_storage_filename.__defaults__
    payload = h.BOUNDS["build_defaults_on_an_allowed_function"]
    monkeypatch.setattr(unpickler, "check_stream", lambda data, resolve: None)
    try:
        with pytest.raises(WeightValidationError, match="BUILD"):
            unpickler.SafeUnpickler(io.BytesIO(payload)).load()
        assert rebuilds.rebuild_storage_filename.__defaults__ == defaults
    finally:
        rebuilds.rebuild_storage_filename.__defaults__ = defaults


LST_BY_REDUCE_STR_KEYS = h.done(
    b"](" + h.s("w") + h.call(h.LST, h.dct(h.s("0"), h.b(b"x"))) + b"\x86e"
)


@pytest.mark.parametrize(
    "payload, fault",
    [
        (h.BOUNDS["local_serialized_tensor_by_reduce"], "dict key"),  # KeyError: 0, a 500 before
        (LST_BY_REDUCE_STR_KEYS, "REDUCE makes a LocalSerializedTensor"),
        (h.BOUNDS["metadata_record_by_reduce"], "REDUCE makes a FlattenedTensorMetadata"),
    ],
)
def test_records_are_made_only_through_their_checks(payload, fault):
    assert fault in refusal(payload, "direct")


def test_local_serialized_tensor_entry_checks_its_values():
    record = LocalSerializedTensor.__new__(LocalSerializedTensor)
    record.values = {1: b"x"}  # as a REDUCE-built record would hold them
    with pytest.raises(WeightValidationError, match="not a list"):
        record.entry(0)


# ---- CUDA IPC: the block the handle opened bounds the storage, fail closed ----------------------

MiB = 2**20
SERVER_ALLOCATION = 16 * MiB  # where, past the sender's block, one of the server's own begins


def cuda_record(nbytes: int, offset: int, ref=(b"", 0)) -> list:
    """rebuild_cuda_tensor's 15 arguments for `nbytes` uint8 at `offset` in an IPC block."""
    handle = b"\x02c" + b"\x01" * 64 if nbytes else None
    return [rebuilds.TENSOR, torch.Size([nbytes]), (1,), 0, rebuilds.TYPED_STORAGE,
            torch.uint8, 0, handle, nbytes, offset, False, ref[0], ref[1], None, False]  # fmt: skip


@pytest.fixture
def fake_cuda(monkeypatch, segments):
    """A CUDA server on the CPU. torch's IPC rebuild returns a tensor whose storage starts at
    block + offset; the driver knows the sender's 1 MiB block and, 16 MiB past its start, a
    1 MiB allocation of the server's own."""
    state = types.SimpleNamespace(allocations={}, opened=[], driver_answers=True)
    state.ref = segments(REF_FILE_BYTES)  # the sender's ref-counter file

    def address_range(ptr: int, device: int = 0):
        for base, size in state.allocations.items():
            if state.driver_answers and base <= ptr < base + size:
                return base, size
        return None

    def rebuild(*args):
        nbytes, offset = args[8], args[9]
        tensor = torch.zeros(nbytes, dtype=torch.uint8)
        block = tensor.untyped_storage().data_ptr() - offset  # where the handle opened
        state.allocations = {block: MiB, block + SERVER_ALLOCATION: MiB}
        state.opened.append(args)
        return tensor

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(rebuilds, "cuda_device_index", lambda device: 0)
    monkeypatch.setattr(rebuilds, "cuda_address_range", address_range)
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", rebuild)
    monkeypatch.delattr(reductions, "_rebuild_cuda_tensor_original", raising=False)
    return state


def test_cuda_storage_inside_its_block_passes(fake_cuda):
    rebuilds.rebuild_cuda_tensor(*cuda_record(4096, MiB - 4096, (fake_cuda.ref, 0)))
    assert len(fake_cuda.opened) == 1


@pytest.mark.parametrize(
    "offset, fault",
    [
        (SERVER_ALLOCATION, "past its IPC block"),  # data_ptr lands inside the server's allocation
        (MiB - 100, "past its IPC block"),  # starts inside, ends 3,996 bytes past
        (3 * MiB, "past its IPC block"),  # lands where the driver knows nothing
    ],
)
def test_cuda_storage_is_bounded_by_the_block_the_handle_opened(fake_cuda, offset, fault):
    with pytest.raises(WeightValidationError, match=fault):
        rebuilds.rebuild_cuda_tensor(*cuda_record(4096, offset, (fake_cuda.ref, 0)))


def test_cuda_bound_fails_closed_when_the_driver_cannot_say(fake_cuda):
    fake_cuda.driver_answers = False  # cuMemGetAddressRange fails
    with pytest.raises(WeightValidationError, match="cuMemGetAddressRange"):
        rebuilds.rebuild_cuda_tensor(*cuda_record(4096, 0, (fake_cuda.ref, 0)))


# ---- CUDA ref counters: only a sender's own counter file ---------------------------------------

REF_FILE_BYTES = REF_COUNTER_FILE_BYTES


@pytest.fixture
def segments():
    """Makes /dev/shm/torch_<pid>_<n>_<n> files; removes them after."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("needs /dev/shm")
    made: list[str] = []

    def make(nbytes: int, pid: int | None = None) -> bytes:
        pid = os.getppid() if pid is None else pid  # a live process that is not the server
        name = f"/torch_{pid}_{os.getpid()}_{len(made)}"
        with open("/dev/shm" + name, "wb") as f:
            f.truncate(nbytes)
        made.append("/dev/shm" + name)
        return name.encode()

    yield make
    for path in made:
        os.unlink(path)


def test_ref_counter_file_of_the_sender_passes(fake_cuda, segments):
    rebuilds.rebuild_cuda_tensor(*cuda_record(4096, 0, (segments(REF_FILE_BYTES), 5)))
    assert len(fake_cuda.opened) == 1


@pytest.mark.parametrize(
    "nbytes, own_pid, fault",
    [
        (1 << 20, False, "not a CUDA ref-counter file"),  # another process's CPU tensor
        (REF_FILE_BYTES + 8, False, "not a CUDA ref-counter file"),
        (REF_FILE_BYTES, True, "this server's own"),
    ],
)
def test_ref_counter_may_not_name_any_other_segment(fake_cuda, segments, nbytes, own_pid, fault):
    handle = segments(nbytes, os.getpid() if own_pid else None)
    with pytest.raises(WeightValidationError, match=fault):
        rebuilds.rebuild_cuda_tensor(*cuda_record(4096, 0, (handle, 0)))
    assert fake_cuda.opened == []  # refused before torch opened anything


@pytest.mark.parametrize("handle", [None, b"", b"/torch_1_2", b"/../../dev/shm/torch_1_2_3"])
def test_a_real_block_must_name_a_ref_counter_file(fake_cuda, handle):
    with pytest.raises(WeightValidationError, match="ref-counter"):
        rebuilds.rebuild_cuda_tensor(*cuda_record(4096, 0, (handle, 0)))
    assert fake_cuda.opened == []


def _cuda_payload(records: list[list]) -> bytes:
    """A direct payload of CUDA records, pickled field for field as a sender's stream."""

    def pickled(r: list) -> bytes:
        size = h.call(h.glob("torch", "Size"), b"(" + b"".join(h.i(d) for d in r[1]) + b"t")
        handle, ref = (h.NONE if v is None else h.b(v) for v in (r[7], r[11]))
        fields = [h.glob("torch", "Tensor"), size, b"(K\x01t", h.i(0)]
        fields += [h.glob("torch.storage", "TypedStorage"), h.glob("torch", "uint8"), h.i(0)]
        fields += [handle, h.i(r[8]), h.i(r[9]), h.FALSE, ref, h.i(r[12]), h.NONE, h.FALSE]
        return h.call(h.glob(h.RED, "rebuild_cuda_tensor"), *fields)

    items = b"".join(b"(" + h.s(f"w{n}") + pickled(r) + b"t" for n, r in enumerate(records))
    return h.done(b"](" + items + b"e")


def test_one_payload_names_one_sender_and_each_counter_once(fake_cuda, segments):
    mine, theirs = segments(REF_FILE_BYTES), segments(REF_FILE_BYTES, pid=1)
    ok = _cuda_payload([cuda_record(64, 0, (mine, 0)), cuda_record(64, 64, (mine, 1))])
    assert len(decode_payload(ok, "direct")) == 2
    twice = _cuda_payload([cuda_record(64, 0, (mine, 3)), cuda_record(64, 64, (mine, 3))])
    with pytest.raises(WeightValidationError, match="twice"):
        decode_payload(twice, "direct")
    mixed = _cuda_payload([cuda_record(64, 0, (mine, 0)), cuda_record(64, 64, (theirs, 0))])
    with pytest.raises(WeightValidationError, match="one sender"):
        decode_payload(mixed, "direct")
