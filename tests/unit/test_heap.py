"""The startup heap frozen (`specray.heap`): what is alive at the freeze leaves the collector's generations, garbage
made later is still collected, and a coordinator freezes once started only as a Serve replica (its own process).
The level actors freeze at their start (`LevelActor`), each a process of its own too."""

from __future__ import annotations

import gc
import weakref

import pytest

from specray.heap import freeze_startup_heap


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()  # back into the oldest generation: other tests see an ordinary heap


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def test_the_startup_heap_leaves_the_collections_and_later_garbage_is_still_collected(unfrozen):
    started = [[i] for i in range(2000)]  # long-lived containers, as a loaded model's modules are
    frozen = freeze_startup_heap()
    assert frozen >= 2000 and gc.get_freeze_count() == frozen
    walked = {id(o) for o in gc.get_objects()}  # what a full collection walks
    assert not any(id(x) in walked for x in started)
    a, b = Node(), Node()  # a cycle made while serving
    a.other, b.other = b, a
    gone = weakref.ref(a)
    del a, b
    gc.collect()
    assert gone() is None


def test_a_replica_freezes_once_started_and_a_coordinator_among_others_does_not(tiny, unfrozen):
    from specray.serve.replica import Coordinator
    from tests.e2e.conftest import app_config

    Coordinator(app_config(tiny))  # built among others in one process (tests, in-process servers)
    assert gc.get_freeze_count() == 0
    coordinator = Coordinator(app_config(tiny), freeze_heap=True)  # as `build_app` binds its replicas
    assert gc.get_freeze_count() > 0 and id(coordinator.engine) not in {id(o) for o in gc.get_objects()}
