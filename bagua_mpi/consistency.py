"""Cross-rank agreement checks: every rank must call a collective with matching arguments.

MPI gives undefined behaviour (a hang, a truncation error, or silently reduced garbage) when
ranks disagree on count or datatype. Before each collective, each rank hashes its *signature*
(operation, op, dtype, shape, root, ...) to a 62-bit integer and the ranks allreduce
``[h, -h]`` with MAX, plus three words for ``join()``, in one 40-byte message: all agree iff
``max(h) == -max(-h)`` (= min h).
Only when they disagree does a second, slower step gather every rank's readable signature, so
the ``MismatchError`` raised on every rank names what each rank passed.

Cost: one extra small allreduce per collective (measured in ``benchmarks/collectives.py``);
turn it off with ``BAGUA_MPI_CHECK=0`` or ``bagua_mpi.set_consistency_check(False)`` once a job
is known to be correct. The execution engine checks bucket layouts once at wrap time and then
each bucket's exchange with one such allreduce (which also lets a rank inside ``join()`` take
part); a step of a few buckets pays a few of them.
"""
from __future__ import annotations

import hashlib

import numpy as np
from mpi4py import MPI

from . import config
from .exceptions import BaguaMPIError, MismatchError


class JoinedRankError(BaguaMPIError):
    """A collective other than allreduce ran while a rank was inside ``join()``."""

_enabled = config.consistency_check()
_hash_cache: dict[tuple, int] = {}
_HASH_MASK = (1 << 62) - 1


def enabled() -> bool:
    return _enabled


def set_enabled(value: bool) -> None:
    """Switch the per-call agreement check on or off for this process.

    All ranks must make the same choice: the check is itself a collective.
    """
    global _enabled
    _enabled = bool(value)


def signature_hash(signature: tuple, cache: bool = True) -> int:
    """Stable (not per-process salted) 62-bit hash of a signature tuple; ``cache=False`` for a
    signature that changes from call to call (it would only fill the cache)."""
    h = _hash_cache.get(signature) if cache else None
    if h is None:
        digest = hashlib.blake2b(repr(signature).encode(), digest_size=8).digest()
        h = int.from_bytes(digest, "little") & _HASH_MASK
        if cache and len(_hash_cache) < 65536:
            _hash_cache[signature] = h
    return h


# The check message, allreduced with MAX: [h, -h, someone joined, -lowest active rank, rank that
# joined in this round]. A rank inside ``join()`` sends JOINED_* (see ``collectives.join``), so the
# ranks still working learn that some rank joined and tell it what to take part in.
_I64_MIN = np.iinfo(np.int64).min
NO_ACTIVE = np.int64(1) << 40


def verify(comm: MPI.Intracomm, signature: tuple, join=None, cache: bool = True) -> bool:
    """Raise ``MismatchError`` on every rank unless all ranks pass an equal signature.

    ``join``: what a rank inside ``join()`` must contribute zeros to (``((wire dtype, count),
    ...), mpi op, hierarchical)``); None for collectives joined ranks cannot take part in.
    ``cache``: see ``signature_hash``. Returns whether some rank is inside ``join()`` (it then
    takes part through MPI).
    """
    h = signature_hash(signature, cache)
    buf = np.array([h, -h, 0, -comm.Get_rank(), -1], dtype=np.int64)
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
    if buf[2]:
        tell_joined(comm, signature, join, bool(buf[0] == -buf[1]), int(-buf[3]))
    if buf[0] != -buf[1]:
        raise_mismatch(comm, signature)
    return bool(buf[2])


def check_called_everywhere(comm: MPI.Intracomm, call: str, why: str) -> None:
    """The agreement check at the start of a collective that scripts tend to call on one rank
    alone (DDP's habit: ``if rank == 0: save(...)``). There it meets the other ranks' next
    checked collective, a bucket of their next step say, and every rank raises
    ``MismatchError`` naming both calls, instead of a hang or an MPI error about a truncated
    message. ``why`` says why every rank must call it. Off with the other checks."""
    if enabled():
        verify(comm, (call, ("collective", why)))


def tell_joined(comm, signature, join, agreed: bool, root: int) -> None:
    """Some rank is inside ``join()``: the lowest active rank tells it what runs now."""
    comm.bcast((signature, join if agreed else None) if comm.Get_rank() == root else None,
               root=root)
    if not agreed:
        raise MismatchError(f"ranks disagree on the arguments of {signature[0]} while some rank "
                            f"has joined (seen from rank {comm.Get_rank()}: "
                            f"{format_signature(signature)})")
    if join is None:
        if signature[0] == "bucket":  # a DistributedOptimizer's exchange, not a user's call
            fields = dict(f for f in signature[1:] if isinstance(f, tuple) and len(f) == 2)
            raise JoinedRankError(
                f"a DistributedOptimizer's exchange (bucket {fields.get('index')}, algorithm "
                f"{fields.get('algorithm')}) met a rank inside bagua_mpi.join(): a joined rank "
                f"can only add zeros to a flat, uncompressed exchange of dense gradients "
                f"(gradient_allreduce, or a dense warm-up, at zero_stage 0 or 1 without "
                f"compression or hierarchical=True), not to this one; the joined ranks stay "
                f"joined")
        raise JoinedRankError(f"{signature[0]} was called while some rank has joined "
                              f"(bagua_mpi.join()); only allreduce and grouped_allreduce accept "
                              f"joined ranks, which contribute zeros; the joined ranks stay "
                              f"joined")


def raise_mismatch(comm: MPI.Intracomm, signature: tuple) -> None:
    """Gather every rank's signature and raise a ``MismatchError`` that lists them."""
    everyone = comm.allgather(signature)
    error = MismatchError(describe_mismatch(comm.Get_rank(), everyone))
    error.signatures = everyone  # for a caller that can say more about its own fields
    raise error


def raised_on_every_rank(error: BaseException) -> bool:
    """Whether ``error`` came from an agreement check that failed, and so was raised on every
    rank of the check alike (it carries the gathered signatures), not on this rank alone."""
    return isinstance(error, MismatchError) and getattr(error, "signatures", None) is not None


def verify_hashes(comm: MPI.Intracomm, hashes, signature: tuple) -> None:
    """For collectives that already exchanged one hash per rank (allgather/alltoall headers)."""
    hashes = np.asarray(hashes)
    if hashes.size and not np.all(hashes == hashes[0]):
        raise_mismatch(comm, signature)


def describe_mismatch(my_rank: int, signatures: list) -> str:
    op = signatures[my_rank][0] if signatures[my_rank] else "collective"
    lines = [f"ranks disagree on the arguments of {op} (seen from rank {my_rank}):"]
    for r, sig in enumerate(signatures):
        lines.append(f"  rank {r}: {format_signature(sig)}")
    return "\n".join(lines)


def ranks_text(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> 'ranks 0-2,5'; [3] -> 'rank 3' (ranks in increasing order)."""
    spans, start = [], ranks[0]
    for prev, cur in zip(ranks, ranks[1:] + [None]):
        if cur != prev + 1:
            spans.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(spans)


def format_signature(sig: tuple) -> str:
    if not sig:
        return "()"
    name, *fields = sig
    # fields are (key, value) pairs; anything else is shown as it is, since this runs while
    # reporting a mismatch and must not fail in its place
    return f"{name}(" + ", ".join(f"{f[0]}={f[1]}" if isinstance(f, tuple) and len(f) == 2
                                  else repr(f) for f in fields) + ")"
