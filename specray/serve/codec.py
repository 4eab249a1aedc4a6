"""The direct transport's messages as plain tuples, pickled.

A level's process sleeps between a round's frames, and what it runs when one comes finds cold caches. Pickle
rebuilds a dataclass through its generic object protocol (a new instance, then a fresh attribute dict per object),
which, cold, costs more than rebuilding the same fields from a tuple: at batch 1 a cascade round's frames spent
about as long being pickled and unpickled as crossing the socket (benchmarks/README.md section 6). So each
round's message classes (`MESSAGES`) go as `(code, field, ...)`, their message-valued fields likewise (declared
per class, never guessed from values), and anything else as `(RAW, value)`, pickled as it is (first-call
sampling parameters, exceptions, tensors inside fields). Codes are positions in `MESSAGES`: both ends run the
same table.
"""

from __future__ import annotations

import enum
from dataclasses import fields, is_dataclass
from typing import Any

__all__ = ["MESSAGES", "RAW", "decode", "encode"]

RAW = -1
_ONE, _MANY = "one", "many"  # a field holding a message (or None) / a list of messages (items may be None)
_METHOD = "specray.spec.params:VerifyMethod"

#: (module, class name, {field: "one" | "many" | "module:Enum"}) per message class
MESSAGES: tuple[tuple[str, str, dict[str, str]], ...] = (
    ("specray.serve.wire", "LevelRequest", {"call": _ONE}),
    ("specray.serve.wire", "ProposeCall", {}),
    ("specray.serve.wire", "VerifyCall", {"method": _METHOD}),
    ("specray.serve.wire", "TreeProposeCall", {}),
    ("specray.serve.wire", "TreeVerifyCall", {"method": _METHOD}),
    ("specray.serve.wire", "NestedCall", {"draft": _ONE}),
    ("specray.serve.wire", "RelayedVerifyCall", {"method": _METHOD}),
    ("specray.serve.wire", "RelayedDrafts", {}),
    ("specray.coordinator.inner", "NestedDraft", {"mid_syncs": _MANY, "low_syncs": _MANY, "method": _METHOD,
                                                  "follow": _ONE}),
    ("specray.coordinator.inner", "NestedOutcome", {"drafts": _ONE, "logs": _MANY}),
    ("specray.coordinator.inner", "InnerLog", {"result": _ONE}),
    ("specray.engine.protocol", "SeqSync", {}),
    ("specray.engine.protocol", "DraftProposal", {}),
    ("specray.engine.protocol", "VerifyResult", {}),
    ("specray.serve.wire", "Verdict", {}),
    ("specray.coordinator.inner", "FollowOn", {}),
    ("specray.serve.wire", "Frees", {}),
)


class _Spec:
    __slots__ = ("cls", "names", "nested")

    def __init__(self, cls: type, names: list[str], nested: list[tuple[int, Any]]) -> None:
        self.cls, self.names, self.nested = cls, names, nested


_SPECS: list[_Spec] = []
_CODES: dict[type, int] = {}


def _load() -> None:
    """Resolve `MESSAGES` on first use (the message modules import torch; the transport need not)."""
    import importlib

    specs: list[_Spec] = []
    for module, name, kinds in MESSAGES:
        mod = importlib.import_module(module)
        cls = getattr(mod, name)
        names = [f.name for f in fields(cls)] if is_dataclass(cls) else list(cls._fields)  # a NamedTuple
        if not set(kinds) <= set(names):
            raise TypeError(f"{name} has no field(s) {sorted(set(kinds) - set(names))}")
        nested = []
        for i, n in enumerate(names):
            if n in kinds:
                kind: Any = kinds[n]
                if kind not in (_ONE, _MANY):  # an Enum: sent as its value, looked up by value
                    enum_module, enum_name = kind.split(":")
                    members = getattr(importlib.import_module(enum_module), enum_name)
                    if not (isinstance(members, type) and issubclass(members, enum.Enum)):
                        raise TypeError(f"{name}.{n}: {kind} is not an Enum")
                    kind = {m.value: m for m in members}
                nested.append((i, kind))
        specs.append(_Spec(cls, names, nested))
    _SPECS[:] = specs
    _CODES.clear()
    _CODES.update({s.cls: code for code, s in enumerate(specs)})


def encode(obj: Any) -> tuple:
    """`obj` as `(code, field values...)` if its class is a message, else `(RAW, obj)`."""
    if not _SPECS:
        _load()
    code = _CODES.get(type(obj))
    if code is None:
        return (RAW, obj)
    spec = _SPECS[code]
    vals = [getattr(obj, n) for n in spec.names]
    for i, kind in spec.nested:
        v = vals[i]
        if v is None:
            continue
        if kind == _ONE:
            vals[i] = encode(v)
        elif kind == _MANY:
            vals[i] = [None if x is None else encode(x) for x in v]
        else:
            vals[i] = v.value if isinstance(v, enum.Enum) else v
    return (code, *vals)


def decode(data: tuple) -> Any:
    """The object `encode` made `data` from."""
    if not _SPECS:
        _load()
    code = data[0]
    if code == RAW:
        return data[1]
    if not isinstance(code, int) or not 0 <= code < len(_SPECS):
        raise ValueError(f"not an encoded message (code {code!r}): both ends must run the same specray")
    spec = _SPECS[code]
    vals = list(data[1:])
    if len(vals) != len(spec.names):
        raise ValueError(f"{spec.cls.__name__}: {len(vals)} values for {len(spec.names)} fields: both ends must "
                         "run the same specray")
    for i, kind in spec.nested:
        v = vals[i]
        if v is None:
            continue
        if kind == _ONE:
            vals[i] = decode(v)
        elif kind == _MANY:
            vals[i] = [None if x is None else decode(x) for x in v]
        else:
            vals[i] = kind.get(v, v)
    return spec.cls(*vals)
