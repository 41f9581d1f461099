"""Hostile weight payloads, for the unpickler tests here and for server fuzz tests later.

Every builder in HOSTILE takes a marker path and returns a raw pickle that, loaded by a plain
`pickle.loads`, creates that file (some first write a helper file or module next to it). A
receiver passes when it refuses each one and the marker never appears. LIVE names the builders
that a plain unpickler really runs here (`run_unsafely` proves it in a child process); the
others need modules (SGLang) this environment lacks. MISUSE holds payloads that stay inside
grctl's allowlist but hand the allowed callables arguments they must refuse.
"""

from __future__ import annotations

import json
import os
import shlex
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

EXT_CODE = 0xF0  # run_unsafely registers ("posix", "system") under this extension code
RED = "torch.multiprocessing.reductions"
NONE, TRUE, FALSE = b"N", b"\x88", b"\x89"

# ---- opcodes (protocol 4 unless a builder says otherwise) ----------------------------------


def s(text: str) -> bytes:
    raw = text.encode()
    head = b"\x8c" + bytes([len(raw)]) if len(raw) < 256 else b"X" + struct.pack("<I", len(raw))
    return head + raw


def b(raw: bytes) -> bytes:
    head = b"C" + bytes([len(raw)]) if len(raw) < 256 else b"B" + struct.pack("<I", len(raw))
    return head + raw


def i(n: int) -> bytes:
    if -(2**31) <= n < 2**31:
        return b"J" + struct.pack("<i", n)
    return b"\x8a\x08" + n.to_bytes(8, "little", signed=True)  # LONG1


def glob(module: str, name: str) -> bytes:
    return s(module) + s(name) + b"\x93"  # STACK_GLOBAL


def call(fn: bytes, *args: bytes) -> bytes:
    return fn + b"(" + b"".join(args) + b"tR"  # MARK args TUPLE REDUCE


def lst(*items: bytes) -> bytes:
    return b"](" + b"".join(items) + b"e"


def partial_kw(fn: bytes, **kwargs: bytes) -> bytes:
    """functools.partial(fn, **kwargs), its keywords set through partial's BUILD state."""
    kw = b"}(" + b"".join(s(k) + v for k, v in kwargs.items()) + b"u"
    return call(glob("functools", "partial"), fn) + b"(" + fn + b")" + kw + NONE + b"tb"


def done(body: bytes) -> bytes:
    return b"\x80\x04" + body + b"."


def touch(marker: Path) -> str:
    return f"touch {shlex.quote(str(marker))}"


def py_touch(marker: Path) -> str:
    return f"open({str(marker)!r}, 'w').close()"


class _CallOnLoad:
    """Pickles as fn(*args), so the real pickler can write hostile files for us."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _evil_pt_bytes(marker: Path) -> bytes:
    import torch

    path = marker.parent / "evil.pt"
    torch.save(_CallOnLoad(os.system, touch(marker)), path)
    return path.read_bytes()


def _evil_module(marker: Path) -> str:
    """A module next to the marker that creates it on import (marker.parent must be on sys.path)."""
    name = "grctl_hostile_" + "".join(c if c.isalnum() else "_" for c in marker.parent.name)
    (marker.parent / f"{name}.py").write_text(py_touch(marker) + "\n")
    return name


# ---- builders: each creates `marker` if a plain unpickler loads it -------------------------

Builder = Callable[[Path], bytes]


def os_system(m: Path) -> bytes:
    return done(call(glob("os", "system"), s(touch(m))))


def posix_system(m: Path) -> bytes:
    return done(call(glob("posix", "system"), s(touch(m))))


def builtins_eval(m: Path) -> bytes:
    return done(call(glob("builtins", "eval"), s(py_touch(m))))


def builtins_exec(m: Path) -> bytes:
    return done(call(glob("builtins", "exec"), s(py_touch(m))))


def builtins_open(m: Path) -> bytes:
    return done(call(glob("builtins", "open"), s(str(m)), s("w")))


def builtins_import_getattr(m: Path) -> bytes:
    os_module = call(glob("builtins", "__import__"), s("os"))
    return done(call(call(glob("builtins", "getattr"), os_module, s("system")), s(touch(m))))


def subprocess_popen(m: Path) -> bytes:
    return done(call(glob("subprocess", "Popen"), lst(s("touch"), s(str(m)))))


def subprocess_getoutput(m: Path) -> bytes:
    return done(call(glob("subprocess", "getoutput"), s(touch(m))))


def importlib_import_module(m: Path) -> bytes:
    return done(call(glob("importlib", "import_module"), s(_evil_module(m))))


def import_side_effect(m: Path) -> bytes:
    """Only names a global: a find_class that imports its module has already lost."""
    return done(glob(_evil_module(m), "anything"))


def torch_save(m: Path) -> bytes:
    return done(call(glob("torch", "save"), i(0), s(str(m))))


def torch_load_partial(m: Path) -> bytes:
    _evil_pt_bytes(m)
    load = partial_kw(glob("torch", "load"), weights_only=FALSE)
    return done(call(load, s(str(m.parent / "evil.pt"))))


def torch_storage_load_from_bytes(m: Path) -> bytes:
    """torch's own storage reducer names this; a prefix allowlist of `torch.` lets it in."""
    return done(call(glob("torch.storage", "_load_from_bytes"), b(_evil_pt_bytes(m))))


def pickle_loads_nested(m: Path) -> bytes:
    return done(call(glob("pickle", "loads"), b(os_system(m))))


def c_pickle_loads_nested(m: Path) -> bytes:
    return done(call(glob("_pickle", "loads"), b(os_system(m))))


def numpy_load_allow_pickle(m: Path) -> bytes:
    path = m.parent / "evil.pkl"
    path.write_bytes(os_system(m))  # np.load falls back to pickle for a non-.npy file
    load = partial_kw(glob("numpy", "load"), allow_pickle=TRUE)
    return done(call(load, s(str(path))))


def numpy_reconstruct_object_array(m: Path) -> bytes:
    import pickle

    import numpy as np

    array = np.empty(1, dtype=object)
    array[0] = _CallOnLoad(os.system, touch(m))
    return pickle.dumps(array, protocol=4)


def numpy_testing_runstring(m: Path) -> bytes:
    return done(call(glob("numpy.testing._private.utils", "runstring"), s(py_touch(m)), b"}"))


def reductions_dotted_os_system(m: Path) -> bytes:
    """An allowed module plus a dotted name: default find_class walks to os.system."""
    return done(call(glob(RED, "os.system"), s(touch(m))))


def torch_dotted_os_system(m: Path) -> bytes:
    return done(call(glob("torch", "serialization.os.system"), s(touch(m))))


def reductions_rebuild_storage_empty(m: Path) -> bytes:
    """rebuild_storage_empty(cls) calls cls(): here open(marker, "w")."""
    opener = call(glob("functools", "partial"), glob("builtins", "open"), s(str(m)), s("w"))
    return done(call(glob(RED, "rebuild_storage_empty"), opener))


def copyreg_reconstructor(m: Path) -> bytes:
    popen = glob("subprocess", "Popen")
    return done(call(glob("copyreg", "_reconstructor"), popen, popen, lst(s("touch"), s(str(m)))))


def opcode_global_reduce(m: Path) -> bytes:  # protocol 0: GLOBAL, UNICODE, TUPLE, REDUCE
    return b"cos\nsystem\n(V" + touch(m).encode() + b"\ntR."


def opcode_inst(m: Path) -> bytes:  # INST calls find_class, then the class with the args
    return b"(V" + touch(m).encode() + b"\nios\nsystem\n."


def opcode_obj(m: Path) -> bytes:  # OBJ calls the first object after MARK with the rest
    return b"(cos\nsystem\nV" + touch(m).encode() + b"\no."


def opcode_build_setstate(m: Path) -> bytes:
    """BUILD puts os.system into an instance dict as __setstate__; the next BUILD calls it."""
    inst = call(glob("types", "SimpleNamespace"))
    inject = b"}(" + s("__setstate__") + glob("os", "system") + b"ub"
    return done(inst + inject + s(touch(m)) + b"b")


def opcode_build_on_allowed_class(m: Path) -> bytes:
    """Same injection on a class grctl allows (SGLang's metadata record)."""
    inst = glob("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata") + b")\x81"
    inject = b"}(" + s("__setstate__") + glob("posix", "system") + b"ub"
    return done(inst + inject + s(touch(m)) + b"b")


def opcode_ext1(m: Path) -> bytes:
    """EXT1: a registered extension code; the C unpickler caches what it resolved once."""
    return done(b"\x82" + bytes([EXT_CODE]) + b"(" + s(touch(m)) + b"tR")


def bucket_with_hostile_metadata(m: Path) -> bytes:
    """A real-looking bucket dict whose last record smuggles in a call."""
    record = call(glob("os", "system"), s(touch(m)))
    return done(b"}(" + s("flattened_tensor") + NONE + s("metadata") + lst(record) + b"u")


HOSTILE: dict[str, Builder] = {
    f.__name__: f
    for f in (
        os_system,
        posix_system,
        builtins_eval,
        builtins_exec,
        builtins_open,
        builtins_import_getattr,
        subprocess_popen,
        subprocess_getoutput,
        importlib_import_module,
        import_side_effect,
        torch_save,
        torch_load_partial,
        torch_storage_load_from_bytes,
        pickle_loads_nested,
        c_pickle_loads_nested,
        numpy_load_allow_pickle,
        numpy_reconstruct_object_array,
        numpy_testing_runstring,
        reductions_dotted_os_system,
        torch_dotted_os_system,
        reductions_rebuild_storage_empty,
        copyreg_reconstructor,
        opcode_global_reduce,
        opcode_inst,
        opcode_obj,
        opcode_build_setstate,
        opcode_build_on_allowed_class,
        opcode_ext1,
        bucket_with_hostile_metadata,
    )
}
LIVE = sorted(set(HOSTILE) - {"opcode_build_on_allowed_class"})  # needs SGLang installed


# ---- misuse of allowed globals: no marker, must still be refused ---------------------------

UNTYPED = glob("torch.storage", "UntypedStorage")
MANAGER = b(b"/tmp/torch-shm-dir-abc123/manager.sock")


def _cuda_args(device: bytes = i(0), nargs: int = 15) -> list[bytes]:
    args = [glob("torch", "Tensor"), call(glob("torch", "Size"), b"(K\x04t"), b"(K\x01t", i(0)]
    args += [glob("torch.storage", "TypedStorage"), glob("torch", "float32"), device]
    args += [b(b"\x00" * 64), i(16), i(0), FALSE, b(b"\x00" * 64), i(0), b(b"\x00" * 64), TRUE]
    return args[:nargs]


def big(n: int) -> bytes:
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw  # LONG1, any size


def _empty_cuda(ref_handle: bytes = NONE, ref_offset: bytes = i(0)) -> bytes:
    """A 0-byte CUDA tensor record (slime's padding): it rebuilds even on a CPU server."""
    args = [glob("torch", "Tensor"), call(glob("torch", "Size"), b"(K\x00t"), b"(K\x01t", i(0)]
    args += [glob("torch.storage", "TypedStorage"), glob("torch", "uint8"), i(0), NONE, i(0)]
    args += [i(0), FALSE, ref_handle, ref_offset, NONE, FALSE]
    return call(glob(RED, "rebuild_cuda_tensor"), *args)


def _empty_bucket(flat: bytes) -> bytes:
    return done(b"}(" + s("flattened_tensor") + flat + s("metadata") + b"]u")


def _bucket_of_record(shape: bytes) -> bytes:
    """A bucket whose one record (grctl's own class, NEWOBJ + BUILD) has this shape tuple."""
    fields = s("name") + s("model.norm.weight") + s("shape") + shape
    fields += s("dtype") + glob("torch", "float32")
    fields += s("start_idx") + i(0) + s("end_idx") + i(0) + s("numel") + i(0)
    record = glob("grctl.weights.wire.records", "FlattenedTensorMetadata") + b")\x81}("
    record += fields + b"ub"
    return done(b"}(" + s("flattened_tensor") + _empty_cuda() + s("metadata") + lst(record) + b"u")


MISUSE: dict[str, bytes] = {
    "tensor_class_called": done(call(glob("torch", "Tensor"), i(10**12))),
    "storage_class_called": done(call(UNTYPED, i(10**12))),
    "parameter_class_newobj": done(glob("torch.nn.parameter", "Parameter") + b")\x81"),
    "shm_handle_path_traversal": done(
        call(glob(RED, "rebuild_storage_filename"), UNTYPED, MANAGER, b(b"/../../etc/passwd"), i(8))
    ),
    "shm_manager_not_torch": done(
        call(
            glob(RED, "rebuild_storage_filename"),
            UNTYPED,
            b(b"/var/run/docker.sock"),
            b(b"/torch_1_2_3"),
            i(8),
        )
    ),
    "shm_handle_not_bytes": done(
        call(glob(RED, "rebuild_storage_filename"), UNTYPED, MANAGER, s("/torch_1_2_3"), i(8))
    ),
    "shm_storage_class_swapped": done(
        call(
            glob(RED, "rebuild_storage_filename"),
            glob("collections", "OrderedDict"),
            MANAGER,
            b(b"/torch_1_2_3"),
            i(8),
        )
    ),
    "rebuild_storage_fd": done(call(glob(RED, "rebuild_storage_fd"), UNTYPED, NONE, i(8))),
    "typed_storage_of_a_dict": done(
        call(glob(RED, "rebuild_typed_storage"), b"}", glob("torch", "float32"))
    ),
    "typed_storage_quantized_dtype": done(
        call(glob(RED, "rebuild_typed_storage"), NONE, glob("torch", "qint8"))
    ),
    "rebuild_tensor_callable_class": done(
        call(glob(RED, "rebuild_tensor"), glob("collections", "OrderedDict"), NONE, NONE)
    ),
    "cuda_tensor_short_args": done(call(glob(RED, "rebuild_cuda_tensor"), *_cuda_args(nargs=6))),
    "cuda_tensor_bad_device": done(
        call(glob(RED, "rebuild_cuda_tensor"), *_cuda_args(device=lst(i(0))))
    ),
    "cuda_tensor_without_cuda_or_bad_uuid": done(
        call(
            glob("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"),
            *_cuda_args(device=s("GPU-00000000-0000-0000-0000-000000000000")),
        )
    ),
    "dotted_name_on_allowed_module": done(glob("torch", "Size.__class__")),
    "metadata_state_injection": done(
        glob("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")
        + b")\x81}("
        + s("__setstate__")
        + glob("torch", "Size")
        + b"ub"
    ),
    "local_serialized_tensor_not_bytes": done(
        glob("sglang.srt.model_executor.model_runner", "LocalSerializedTensor")
        + b")\x81}("
        + s("values")
        + lst(i(1))
        + b"ub"
    ),
    "record_dim_past_int64": _bucket_of_record(b"(K\x00" + big(2**70) + b"t"),
    "cuda_ref_counter_offset_past_the_file": _empty_bucket(
        _empty_cuda(b(b"/torch_1_2_3"), i(10_000))
    ),
    "cuda_ref_counter_offset_negative": _empty_bucket(_empty_cuda(b(b"/torch_1_2_3"), i(-1))),
    "cuda_ref_counter_handle_not_a_segment": _empty_bucket(
        _empty_cuda(b(b"/../../dev/shm/x"), i(0))
    ),
    "persistent_id": done(s("x") + b"Q"),
    "truncated": os_system(Path("/nonexistent/marker"))[:12],
    "not_a_pickle": b"\x80\x04this is not a pickle",
}


def run_unsafely(builders: list[str], root: Path) -> dict[str, bool]:
    """Loads each payload with plain pickle in a child process; which markers appeared."""
    script = (
        "import copyreg, json, os, pickle, sys, time\n"
        "from pathlib import Path\n"
        "from tests.support import hostile_pickles as h\n"
        "copyreg.add_extension('posix', 'system', h.EXT_CODE)\n"
        "root = Path(sys.argv[1]); names = sys.argv[2:]\n"
        "for name in names:\n"
        "    marker = root / name / 'marker'\n"
        "    marker.parent.mkdir(parents=True)\n"
        "    sys.path.insert(0, str(marker.parent))\n"
        "    payload = h.HOSTILE[name](marker)\n"
        "    try:\n"
        "        pickle.loads(payload)\n"
        "    except Exception:\n"
        "        pass\n"
        "deadline = time.time() + 5\n"
        "while time.time() < deadline and not all((root / n / 'marker').exists() for n in names):\n"
        "    time.sleep(0.05)\n"
        "print(json.dumps({n: (root / n / 'marker').exists() for n in names}))\n"
    )
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", script, str(root), *builders],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---- stalls, growth and writes: payloads inside the allowlist that a receiver must bound ----

LST = glob("sglang.srt.model_executor.model_runner", "LocalSerializedTensor")


def shared_nest(depth: int, empty: bytes = b"]", close: bytes = b"l") -> bytes:
    """x = [x, x] (or a tuple), `depth` times over: 7 bytes a level, 2**depth items unfolded."""
    body = empty + b"\x94" + b"0"  # MEMOIZE the innermost, POP it
    for level in range(depth):
        ref = b"h" + bytes([level])  # BINGET
        body += b"(" + ref + ref + close + b"\x94" + b"0"
    return body + b"h" + bytes([depth])


def deep_nest(depth: int) -> bytes:
    """A tuple nested `depth` deep: hashing it recurses once a level in C."""
    return b"(" * depth + b")" + b"t" * depth


def memo_put_at(index: int) -> bytes:
    """LONG_BINPUT at `index`: the C unpickler grows its memo array to twice that."""
    return NONE + b"r" + struct.pack("<I", index)


def _build_on(target: bytes, slot_state: bytes) -> bytes:
    """BUILD with (None, slot_state): the unpickler setattr()s each slot on the target."""
    return target + b"(" + NONE + slot_state + b"tb"


def dct(*pairs: bytes) -> bytes:
    return b"}(" + b"".join(pairs) + b"u"


# Each is refused, fast, and leaves the process as it was (no object changed, no memory kept).
BOUNDS: dict[str, bytes] = {
    # x = [x, x] 22 deep as rebuild_tensor's class: formatting its repr took 2.7 s
    "shared_lists_in_a_message": done(
        call(glob(RED, "rebuild_tensor"), shared_nest(22), NONE, NONE)
    ),
    "shared_tuples_as_a_dict_key": done(
        b"}" + shared_nest(40, empty=b")", close=b"t") + i(1) + b"s"
    ),
    "deep_tuple_as_a_dict_key": done(b"}" + deep_nest(200_000) + i(1) + b"s"),
    "deep_lists": done(b"(" * 100_000 + b"]" + b"l" * 100_000),
    "memo_index_far_ahead": done(memo_put_at(2**26)),
    "colliding_int_keys": done(
        b"}(" + b"".join(big(k * (2**61 - 1)) + NONE for k in range(1, 2000)) + b"u"
    ),
    "set_of_items": done(b"\x8f(" + i(1) + i(2) + b"\x90"),  # EMPTY_SET MARK ... ADDITEMS
    "build_defaults_on_an_allowed_function": done(
        _build_on(glob(RED, "rebuild_storage_filename"), dct(s("__defaults__"), b"(K\x07t"))
    ),
    "build_on_a_class_token": done(_build_on(glob("torch", "Tensor"), dct(s("name"), s("x")))),
    "build_on_an_ordered_dict": done(
        _build_on(call(glob("collections", "OrderedDict")), dct(s("x"), i(1)))
    ),
    "build_on_a_record_class": done(
        glob("grctl.weights.wire.records", "LocalSerializedTensor")
        + dct(s("values"), lst(b(b"x")))
        + b"b"
    ),
    "local_serialized_tensor_by_reduce": done(
        b"](" + s("w") + call(LST, dct(i(1), b(b"x"))) + b"\x86e"
    ),
    "metadata_record_by_reduce": done(
        call(glob("grctl.weights.wire.records", "FlattenedTensorMetadata"), *[NONE] * 6)
    ),
}
