"""Run a suite's checks one by one and report each on its own line.

``run_checks(checks)`` runs every check (or only those named by ``--check NAME``, repeatable)
on every rank. A check that raises is reported as failed and the suite goes on with the next
one; after each check the ranks agree on the outcome (one small allgather), so rank 0 prints
``CHECK <name> PASS`` or ``CHECK <name> FAIL rank <r>: <error>`` for every check, and the job
exits non-zero at the end if any failed. The pytest side (``mpi_harness.check_lines``) turns
each line into its own test result.

Checks are written so that a wrong result fails on every rank at the same point (they assert on
values every rank computes alike, after the collectives of the check); a rank that fails alone
in the middle of a check could leave the others waiting, which the stall watchdog and the
harness timeout still end.
"""
from __future__ import annotations

import sys
import traceback

import bagua_mpi as bm


def selected(names: list[str], argv: list[str]) -> list[str]:
    wanted = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--check"]
    unknown = set(wanted) - set(names)
    if unknown:
        raise SystemExit(f"unknown check(s) {sorted(unknown)}; valid: {', '.join(names)}")
    return [n for n in names if n in wanted] if wanted else names


def run_checks(checks: dict, argv: list[str] | None = None, comm=None) -> int:
    """Run ``checks`` (name -> fn(rank, size)); print one line per check; return #failures.

    The ranks agree on each outcome through the library (initialized by the caller), or through
    ``comm``, an mpi4py communicator, for checks that initialize and shut it down themselves."""
    argv = sys.argv if argv is None else argv
    rank, size = (bm.rank(), bm.size()) if comm is None else (comm.Get_rank(), comm.Get_size())
    allgather = bm.allgather_object if comm is None else comm.allgather
    failures = 0
    for name in selected(list(checks), argv):
        error = None
        try:
            checks[name](rank, size)
        except Exception as exc:  # noqa: BLE001 - reported, then the next check runs
            error = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()  # every rank's traceback lands in the job's output
        outcomes = allgather(error)
        failed = [(r, e) for r, e in enumerate(outcomes) if e is not None]
        if rank == 0:
            if failed:
                r, e = failed[0]
                first = e.splitlines()[0] if e else ""
                print(f"CHECK {name} FAIL rank {r}: {first[:300]}", flush=True)
            else:
                print(f"CHECK {name} PASS", flush=True)
        failures += bool(failed)
    return failures


def run_suite(checks: dict) -> int:
    """A suite's whole job: ``bm.init()``, the selected checks, ``bm.shutdown()``; the exit
    status (1 if any check failed)."""
    bm.init()
    failures = run_checks(checks)
    bm.shutdown()
    return 1 if failures else 0


def expect(exc, fn, *needles):
    """Call ``fn``: it must raise ``exc`` with every one of ``needles`` in its message; the
    exception is returned for further checks."""
    try:
        fn()
    except exc as e:
        for needle in needles:
            assert needle in str(e), f"{needle!r} not in {e!r}"
        return e
    raise AssertionError(f"{fn} did not raise {exc.__name__}")
