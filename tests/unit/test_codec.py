"""The direct transport's message codec (`specray.serve.codec`): every round message survives the trip field for
field, message-valued fields are never left to pickle, and a frame from another codec fails clearly."""

from __future__ import annotations

import importlib
import pickle
import re
from dataclasses import fields, is_dataclass

import pytest
import torch

from specray.coordinator.inner import FollowOn, InnerLog, NestedDraft, NestedOutcome
from specray.engine.protocol import DraftProposal, SeqSync, VerifyResult
from specray.serve import codec
from specray.serve.wire import (
    Frees,
    LevelRequest,
    NestedCall,
    ProposeCall,
    RelayedDrafts,
    RelayedVerifyCall,
    TreeProposeCall,
    TreeVerifyCall,
    Verdict,
    VerifyCall,
)
from specray.spec.ngram import NgramConfig
from specray.spec.params import SamplingParams, VerifyMethod

EP = (("127.0.0.1", 4321), "tok")


def _same(a, b) -> bool:
    """Equal, with tensors compared by value and dataclasses / named tuples field by field."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if type(a) is not type(b):
        return False
    if is_dataclass(a):
        return all(_same(getattr(a, f.name), getattr(b, f.name)) for f in fields(a))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, BaseException):
        return str(a) == str(b)
    return a == b


def _trip(obj):
    return codec.decode(pickle.loads(pickle.dumps(codec.encode(obj), protocol=pickle.HIGHEST_PROTOCOL)))


def _messages():
    sp = SamplingParams(temperature=0.7, top_k=5, seed=3)
    vr = VerifyResult([[4, 5], [6]], [1, 0], probs=torch.rand(2, 2, 7), native_drafts=[3, 0],
                      native_cold=[False, True], stepped=True, confidence=[[0.9, 0.4], [0.2]], tree_nodes=[3, 1])
    dp = DraftProposal([[1, 2, 3], []], probs=torch.rand(2, 3, 7))
    draft = NestedDraft(mid=1, low=0, seq_ids=["a", "b"], sampling=[sp, sp],
                        mid_syncs=[SeqSync(3, (1, 2)), None], low_syncs=[SeqSync.start([9, 8, 7]), SeqSync(2, ())],
                        want=[4, 2], k_low=3, method=VerifyMethod.COUPLED, mode="sample", need_probs=True,
                        confidence=0.5, stop_below=0.1, vocab=7, min_share=0.25,
                        lookup=NgramConfig(), mid_owed=[1, 0], low_owed=[2, 2], follow=FollowOn(4, (10, 3)))
    log = InnerLog([0, 1], [[1, 2], [3]], vr, 0.01, 0.02, 2, None, (3, 5, True), (0, 0, False), 2)
    out = NestedOutcome(dp, [[1, 2], [3]], [[1], []], [log, log], RuntimeError("level below failed"), True, True, [1])
    calls = [
        ProposeCall(["a", "b"], [3, 1], [sp, None], "greedy", 0, [(0, (1, 2)), None], 0.2, (EP, "key")),
        VerifyCall(["a"], [[1, 2]], torch.rand(1, 2, 7), [None], VerifyMethod.REJECTION, 2, None, True, False),
        TreeProposeCall(["a"], [2], [None], "greedy", 0, [(4, ())], 2, [5]),
        TreeVerifyCall(["a"], [((1, 2, 3), (-1, 0, 0)), None], None, [None], VerifyMethod.GREEDY, 1, None),
        NestedCall(draft, [sp, None], [None, None], EP, ("x",), poll=True, relay=(EP, "key")),
        NestedCall(draft, [None, None], [None, None], None, ()),
        RelayedVerifyCall("key", ["a", "b"], [None, sp], VerifyMethod.DETERMINISTIC, 2, [(5, (1,)), None], [1]),
        RelayedVerifyCall("key", ["a"], [None], VerifyMethod.GREEDY, 2, None, [0], forward=EP),
    ]
    return ([LevelRequest(("f1", "f2"), c) for c in calls] + calls
            + [RelayedDrafts("key", [[1, 2]], torch.rand(1, 2, 7), abort="gone"), Verdict("key", [[4, 5], [6]]),
               FollowOn(2, (7,)), Frees(("a", "b")), draft, log, out, vr, dp,
               SeqSync(1, (2, 3)), VerifyResult([[1]], [0])])


@pytest.mark.parametrize("msg", _messages(), ids=lambda m: type(m).__name__)
def test_every_round_message_survives_the_trip_field_for_field(msg):
    back = _trip(msg)
    assert _same(back, msg)
    assert codec.encode(msg)[0] != codec.RAW


def test_every_message_class_is_covered_and_values_that_are_not_messages_pass_as_they_are():
    covered = {type(m) for m in _messages()}
    declared = {getattr(importlib.import_module(mod), name) for mod, name, _ in codec.MESSAGES}
    assert declared == covered
    for value in [{"poll": True}, 1.5, None, ValueError("boom"), [SamplingParams()], ("a", 1)]:
        assert codec.encode(value)[0] == codec.RAW
        assert _same(_trip(value), value)


def test_fields_that_hold_messages_are_declared_so_none_is_left_to_pickle():
    """A field whose annotation names a message class (or VerifyMethod) must be declared in `MESSAGES`: else it
    would still arrive intact, pickled whole, and the codec's gain would quietly fade."""
    classes = {getattr(importlib.import_module(mod), name): kinds for mod, name, kinds in codec.MESSAGES}
    names = {c.__name__ for c in classes}
    for cls, kinds in classes.items():
        annotated = (fields(cls) if is_dataclass(cls) else
                     [type("F", (), {"name": n, "type": str(cls.__annotations__[n])}) for n in cls._fields])
        for f in annotated:
            words = set(re.findall(r"\w+", str(f.type)))
            if words & names or "VerifyMethod" in words:
                assert f.name in kinds, f"{cls.__name__}.{f.name} ({f.type}) is not declared in codec.MESSAGES"


def test_a_frame_from_another_codec_fails_with_a_clear_error():
    for code in (999, -2, "x"):
        with pytest.raises(ValueError, match="same specray"):
            codec.decode((code, 1, 2))
    code, *vals = codec.encode(SeqSync(1, (2,)))
    with pytest.raises(ValueError, match="same specray"):
        codec.decode((code, *vals, "extra"))
