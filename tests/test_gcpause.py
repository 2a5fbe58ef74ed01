"""The GC paused around bulk metadata: what only the GC can free is still freed."""

from __future__ import annotations

import gc
import weakref

from shardstore.gcpause import gc_paused


class _Big:
    """Stands for a rank file's buffer, held by a frame an exception's traceback keeps."""


def test_cyclic_garbage_made_while_paused_is_freed_and_nothing_else_is_lost() -> None:
    kept = []
    with gc_paused():
        assert not gc.isenabled()
        big = _Big()
        cycle: list = [big]
        cycle.append(cycle)  # garbage that reference counting alone never frees
        gone = weakref.ref(big)
        del big, cycle
        kept.append(_Big())  # a survivor, still referenced
        assert gone() is not None
    assert gc.isenabled()
    assert gone() is None
    assert isinstance(kept[0], _Big)


def test_a_nested_pause_leaves_the_outer_one_in_charge() -> None:
    with gc_paused():
        with gc_paused():
            pass
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_pause_without_the_pass_freezes_what_survives_untouched() -> None:
    """Around one unpickling the pass is skipped: a cycle made there stays (frozen), as before."""
    with gc_paused(collect=False):
        cycle: list = [_Big()]
        cycle.append(cycle)
        gone = weakref.ref(cycle[0])
        del cycle
    gc.collect()
    assert gone() is not None  # frozen: out of the collector's sight
    gc.unfreeze()
    gc.collect()
    assert gone() is None
