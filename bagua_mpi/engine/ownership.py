"""Which engine's hooks a parameter carries: the newest ``DistributedOptimizer`` over it.

An engine hooks every parameter it exchanges, and the hooks keep it alive for as long as the
parameters live: dropping the optimizer (``del opt``, or binding the name to a new one) does
not remove them. A script that wraps the same parameters again (a new optimizer per epoch or
per fine-tuning phase, as trainers do; layers unfrozen into a new optimizer) would then carry
two sets of hooks, and the earlier engine, whose ``step()`` never comes again, would refuse
the next backward pass. So wrapping parameters takes them over:

1. ``open_over(params)`` finds the open engines hooked on any of them (in the order they were
   built), before the new wrapper's agreement check, which compares how many it replaces (a
   rank that closed its earlier optimizer and a rank that did not would otherwise disagree on
   whether the earlier one's closing collectives run);
2. the new wrapper closes each of them (``Engine.close(reason)``: background work stopped by
   the algorithm's ``close``, hooks removed); the earlier optimizer's ``step()`` then raises
   ``MisuseError`` naming the reason, rather than stepping on gradients it no longer exchanges;
3. the new engine registers itself (``register``).

Only open engines are held, weakly: a closed engine is forgotten.
"""
from __future__ import annotations

import itertools
import weakref

_open_engines: "weakref.WeakSet" = weakref.WeakSet()
_serial = itertools.count()


def register(engine) -> int:
    """Record ``engine`` as open; returns its serial number (the order engines were built)."""
    _open_engines.add(engine)
    return next(_serial)


def forget(engine) -> None:
    _open_engines.discard(engine)


def open_over(params) -> list:
    """The open engines hooked on any of ``params``, oldest first."""
    wanted = {id(p) for p in params}
    found = [e for e in list(_open_engines) if any(id(p) in wanted for p in e.params)]
    return sorted(found, key=lambda e: e.serial)


def shared_names(engine, params) -> list[str]:
    """The names, in ``engine``, of the parameters it shares with ``params``."""
    wanted = {id(p) for p in params}
    return [n for n, p in zip(engine.names, engine.params) if id(p) in wanted]


def close_replaced(engines, params, by: str) -> None:
    """Close ``engines`` (from ``open_over(params)``) for a wrapper, ``by``, that takes over
    ``params`` (an algorithm's closing exchange, where it has one, is collective: every rank
    replaces alike, as the agreement check made sure)."""
    for engine in engines:
        names = shared_names(engine, params)
        shown = ", ".join(repr(n) for n in names[:3]) + (", ..." if len(names) > 3 else "")
        engine.close(f"{by} wrapped later over its parameters ({len(names)} of them: "
                     f"{shown}) took them over; step that one")
