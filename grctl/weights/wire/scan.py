"""The pre-scan of a payload's pickle stream: what it may make the unpickler build, checked
before anything is built.

The C unpickler does what the opcodes say at C speed, holding the GIL: it grows its memo to
any index it is given, nests containers past the C stack, and builds objects that share one
another so that a few hundred bytes unfold to 2**n items (every repr, hash or comparison then
walks all of them). So the stream first runs through a model of the pickle machine, in plain
Python (which lets other threads run), that knows for every object what it is, how deep it
nests and how many items it unfolds to. It refuses the stream when:
- it has more than MAX_OPCODES opcodes or MAX_MEMO memo entries, or a memo index past the
  next free one;
- an object nests deeper than MAX_DEPTH, or unfolds to more than UNFOLD_PER_OPCODE items per
  opcode read so far (plus UNFOLD_SLACK): a sender's stream unfolds to about its own length;
- it runs more than MAX_OPCODES_WITHOUT_A_CALL opcodes without calling into Python, where the
  C unpickler could let other threads run;
- it names a global off the allowlist (`resolve`), calls (REDUCE) anything but an allowlisted
  function (OrderedDict only without arguments), makes (NEWOBJ) anything but a wire record, or
  BUILDs anything but a wire record it made (so no allowlisted object can be changed);
- a dict key is not a str (str hashes are salted; int and tuple keys can be made to collide),
  or it uses sets, INST, OBJ, extensions, persistent ids or out-of-band buffers;
- a container changes after it was put inside another: so nothing contains itself, and every
  count above stays exact.
"""

from __future__ import annotations

import collections
import pickletools
from collections.abc import Callable
from dataclasses import dataclass

from grctl.errors import WeightValidationError
from grctl.weights.wire.records import FlattenedTensorMetadata, LocalSerializedTensor

MAX_OPCODES = 1 << 20  # 30-45 opcodes a tensor: over 20,000 tensors in one payload
MAX_MEMO = 1 << 20
MAX_DEPTH = 32  # a sender's bucket nests 8 deep
UNFOLD_PER_OPCODE = 8
UNFOLD_SLACK = 4096
# The C unpickler holds the GIL from one call into Python (find_class, a rebuild function, a
# record's __setstate__) to the next; a sender's stream calls one every few dozen opcodes.
MAX_OPCODES_WITHOUT_A_CALL = 4096

RECORDS = (FlattenedTensorMetadata, LocalSerializedTensor)

_LEAVES = frozenset(
    "INT BININT BININT1 BININT2 LONG LONG1 LONG4 FLOAT BINFLOAT NONE NEWTRUE NEWFALSE STRING "
    "BINSTRING SHORT_BINSTRING BINBYTES SHORT_BINBYTES BINBYTES8 BYTEARRAY8".split()
)
_TEXT = frozenset("UNICODE SHORT_BINUNICODE BINUNICODE BINUNICODE8".split())
_REFUSED = {
    **dict.fromkeys(("EXT1", "EXT2", "EXT4"), "extension codes"),
    **dict.fromkeys(("PERSID", "BINPERSID"), "persistent ids"),
    **dict.fromkeys(("INST", "OBJ"), "the protocol 0 and 1 object opcodes"),
    **dict.fromkeys(("EMPTY_SET", "ADDITEMS", "FROZENSET"), "sets"),
    **dict.fromkeys(("NEXT_BUFFER", "READONLY_BUFFER"), "out-of-band buffers"),
}


_KINDS = {
    "leaf": "a number, bytes or None",
    "str": "a str",
    "list": "a list",
    "dict": "a dict",
    "tuple": "a tuple",
    "global": "an allowlisted global",
    "record": "a wire record the payload made",
    "object": "what an allowlisted function returned",
}


def _refuse(what: str) -> WeightValidationError:
    return WeightValidationError(f"tensor payload refused: {what}")


class _Obj:
    """One object the stream builds: its kind, items unfolded, nesting depth, and whether it
    already sits inside another (then it may not change)."""

    __slots__ = ("kind", "size", "depth", "placed", "value")

    def __init__(self, kind: str, size: int = 1, depth: int = 0, value: object = None):
        self.kind, self.size, self.depth, self.value = kind, size, depth, value
        self.placed = False


@dataclass(frozen=True)
class ScanReport:
    num_opcodes: int
    num_memo: int
    max_depth: int
    max_unfolded: int
    max_opcodes_without_a_call: int


class _Machine:
    """The pickle machine with objects reduced to what the bounds need. Like the C
    unpickler's, its stack is a list with MARKs kept apart as positions in it."""

    def __init__(self, resolve: Callable[[str, str], object]):
        self.resolve = resolve
        self.stack: list[_Obj] = []
        self.marks: list[int] = []
        self.memo: list[_Obj] = []
        self.num_opcodes = self.max_depth = self.max_unfolded = 0
        self.last_call = self.max_run = 0  # the opcode count at the last call into Python

    def top(self) -> _Obj:
        if not self.stack or (self.marks and self.marks[-1] == len(self.stack)):
            raise _refuse("an opcode finds no object on the pickle stack")
        return self.stack[-1]

    def pop_n(self, n: int) -> list[_Obj]:
        floor = self.marks[-1] if self.marks else 0
        if len(self.stack) - n < floor:
            raise _refuse("an opcode finds too few objects on the pickle stack")
        items = self.stack[-n:]
        del self.stack[-n:]
        return items

    def pop_mark(self) -> list[_Obj]:
        if not self.marks:
            raise _refuse("an opcode finds no MARK on the pickle stack")
        at = self.marks.pop()
        items = self.stack[at:]
        del self.stack[at:]
        return items

    def pop_any(self, arg: object) -> None:
        if self.marks and self.marks[-1] == len(self.stack):
            self.marks.pop()  # POP right after a MARK drops the MARK, as the C unpickler does
        elif self.stack:
            self.stack.pop()
        else:
            raise _refuse("POP on an empty pickle stack")

    def mark(self, arg: object) -> None:
        if len(self.marks) >= MAX_DEPTH:  # each open MARK is a container being built
            raise _refuse(f"it nests objects more than {MAX_DEPTH} deep")
        self.marks.append(len(self.stack))

    def put(self, index: object) -> None:
        obj = self.top()
        if not (type(index) is int and 0 <= index <= len(self.memo)):
            raise _refuse(f"memo index {index} skips past the next free one ({len(self.memo)})")
        if index < len(self.memo):
            self.memo[index] = obj
        elif index >= MAX_MEMO:
            raise _refuse(f"it stores more than {MAX_MEMO} memo entries")
        else:
            self.memo.append(obj)

    def get(self, index: object) -> None:
        if not (type(index) is int and 0 <= index < len(self.memo)):
            raise _refuse(f"memo index {index} was never stored")
        self.stack.append(self.memo[index])

    def check(self, obj: _Obj) -> _Obj:
        if obj.depth > MAX_DEPTH:
            raise _refuse(f"it nests objects more than {MAX_DEPTH} deep")
        allowed = UNFOLD_PER_OPCODE * self.num_opcodes + UNFOLD_SLACK
        if obj.size > allowed:
            raise _refuse(
                f"an object in it would unfold to {obj.size} items after {self.num_opcodes} "
                f"opcodes, past {allowed} (objects that hold one another over and over)"
            )
        if obj.depth > self.max_depth:
            self.max_depth = obj.depth
        if obj.size > self.max_unfolded:
            self.max_unfolded = obj.size
        return obj

    def make(self, kind: str, items: list[_Obj], value: object = None) -> _Obj:
        size, depth = 1, 0
        for item in items:
            item.placed = True
            size += item.size
            if item.depth >= depth:
                depth = item.depth + 1
        return self.check(_Obj(kind, size, depth, value))

    def grow(self, op: str, kind: str, items: list[_Obj]) -> None:
        """`op` adds `items` in place to the object under them: only to a `kind` that is not
        yet inside another object."""
        for item in items:
            item.placed = True  # first: a container put into itself is then refused below
        target = self.top()
        if target.kind != kind:
            raise _refuse(f"{op} on {_KINDS[target.kind]}: only {_KINDS[kind]} takes that here")
        if target.placed:
            raise _refuse("it changes a container after putting it inside another")
        for item in items:
            target.size += item.size
            if item.depth >= target.depth:
                target.depth = item.depth + 1
        self.check(target)

    def keyed(self, items: list[_Obj]) -> list[_Obj]:
        if len(items) % 2:
            raise _refuse("a dict's items do not pair up")
        if any(key.kind != "str" for key in items[::2]):
            raise _refuse("a dict key is not a str")
        return items

    def push_global(self, module: object, name: object) -> None:
        if not isinstance(module, str) or not isinstance(name, str):
            raise _refuse("a global's module and name are not literal strings")
        self.stack.append(_Obj("global", value=self.resolve(module, name)))
        self.called()  # find_class

    def called(self) -> None:
        self.last_call = self.num_opcodes

    def check_run(self) -> None:
        run = self.num_opcodes - self.last_call
        if run > MAX_OPCODES_WITHOUT_A_CALL:
            raise _refuse(
                f"it runs {run} opcodes without calling one of grctl's functions, past "
                f"{MAX_OPCODES_WITHOUT_A_CALL}: the unpickler would hold the GIL all along"
            )
        if run > self.max_run:
            self.max_run = run

    def reduce(self, arg: object) -> None:
        fn, args = self.pop_n(2)
        target = fn.value if fn.kind == "global" else None
        if args.kind != "tuple":
            raise _refuse("REDUCE's arguments are not a tuple")
        if isinstance(target, type) and issubclass(target, RECORDS):
            raise _refuse(
                f"REDUCE makes a {target.__name__} without its checks (records come by "
                "NEWOBJ and BUILD, as a dataclass pickles)"
            )
        if target is collections.OrderedDict:
            if args.size != 1:
                raise _refuse("REDUCE calls OrderedDict with arguments")
            self.stack.append(self.make("dict", [fn, args]))
        elif callable(target):
            self.stack.append(self.make("object", [fn, args]))
            if not isinstance(target, type):  # a rebuild function, not torch.Size
                self.called()
        else:
            raise _refuse("REDUCE may call only grctl's rebuild functions, torch.Size, OrderedDict")

    def newobj(self, n: int) -> None:
        cls, *items = self.pop_n(n)
        target = cls.value if cls.kind == "global" else None
        if not (isinstance(target, type) and issubclass(target, RECORDS)):
            raise _refuse("NEWOBJ may make only the wire records")
        self.stack.append(self.make("record", [cls, *items], value=target))


def _push(kind: str) -> Callable[[_Machine, object], None]:
    return lambda machine, arg: machine.stack.append(_Obj(kind, value=arg))


def _build(kind: str, take: Callable[[_Machine], list[_Obj]]) -> Callable[[_Machine, object], None]:
    return lambda machine, arg: machine.stack.append(machine.make(kind, take(machine)))


def _grow(op: str, kind: str, take: Callable[[_Machine], list[_Obj]]):
    return lambda machine, arg: machine.grow(op, kind, take(machine))


def _pop(n: int) -> Callable[[_Machine], list[_Obj]]:
    return lambda machine: machine.pop_n(n)


def _pairs(take: Callable[[_Machine], list[_Obj]]) -> Callable[[_Machine], list[_Obj]]:
    return lambda machine: machine.keyed(take(machine))


_M = _Machine
_OPS: dict[str, Callable[[_Machine, object], None]] = {
    **{name: _push("leaf") for name in _LEAVES},  # value: ignored
    **{name: _push("str") for name in _TEXT},  # value: the text, for STACK_GLOBAL
    **{name: _M.put for name in ("PUT", "BINPUT", "LONG_BINPUT")},
    **{name: _M.get for name in ("GET", "BINGET", "LONG_BINGET")},
    "MEMOIZE": lambda machine, arg: machine.put(len(machine.memo)),
    "MARK": _M.mark,
    "POP": _M.pop_any,
    "POP_MARK": lambda machine, arg: machine.pop_mark() and None,
    "DUP": lambda machine, arg: machine.stack.append(machine.top()),
    "EMPTY_LIST": _push("list"),
    "EMPTY_DICT": _push("dict"),
    "EMPTY_TUPLE": _push("tuple"),
    "TUPLE": _build("tuple", _M.pop_mark),
    "TUPLE1": _build("tuple", _pop(1)),
    "TUPLE2": _build("tuple", _pop(2)),
    "TUPLE3": _build("tuple", _pop(3)),
    "LIST": _build("list", _M.pop_mark),
    "DICT": _build("dict", _pairs(_M.pop_mark)),
    "APPEND": _grow("APPEND", "list", _pop(1)),
    "APPENDS": _grow("APPENDS", "list", _M.pop_mark),
    "SETITEM": _grow("SETITEM", "dict", _pairs(_pop(2))),
    "SETITEMS": _grow("SETITEMS", "dict", _pairs(_M.pop_mark)),
    "BUILD": lambda machine, arg: (
        machine.grow("BUILD", "record", machine.pop_n(1)) or machine.called()
    ),
    "GLOBAL": lambda machine, arg: machine.push_global(*arg.partition(" ")[::2]),
    "STACK_GLOBAL": lambda machine, arg: machine.push_global(
        *(o.value if o.kind == "str" else None for o in machine.pop_n(2))
    ),
    "REDUCE": _M.reduce,
    "NEWOBJ": lambda machine, arg: machine.newobj(2),
    "NEWOBJ_EX": lambda machine, arg: machine.newobj(3),
    **{name: lambda machine, arg: None for name in ("PROTO", "FRAME", "STOP")},
}


def _unknown(name: str) -> str:
    what = _REFUSED.get(name)
    if what is None:
        return f"pickle opcode {name} is not part of the wire format"
    return f"{what} are not part of the wire format (opcode {name})"


def check_stream(data: bytes, resolve: Callable[[str, str], object]) -> ScanReport:
    """Refuse `data` (a WeightValidationError) unless unpickling it stays inside the bounds
    above; `resolve(module, name)` is the allowlist, raising for any global not on it."""
    machine, ops, limit = _Machine(resolve), _OPS, MAX_OPCODES
    try:
        for opcode, arg, _pos in pickletools.genops(data):
            machine.num_opcodes += 1
            if machine.num_opcodes > limit:
                raise _refuse(f"it has more than {limit} opcodes; send fewer tensors a call")
            op = ops.get(opcode.name)
            if op is None:
                raise _refuse(_unknown(opcode.name))
            op(machine, arg)
            machine.check_run()
    except WeightValidationError:
        raise
    except Exception as exc:  # genops on a malformed stream: truncated, bad opcode, bad text
        raise _refuse(f"not a valid pickle ({type(exc).__name__}: {str(exc)[:200]})") from None
    return ScanReport(
        machine.num_opcodes,
        len(machine.memo),
        machine.max_depth,
        machine.max_unfolded,
        machine.max_run,
    )
