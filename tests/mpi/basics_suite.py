"""The collectives, asynchronous handles and the misuse guards that leave the library working,
in one job per world size: ``python basics_suite.py --check NAME ...`` on every rank.

Each is the same check its own suite runs alone (``collectives_suite``'s and ``async_suite``'s
checks, named ``collectives-<check>`` and ``async-<check>`` here, and ``faults_suite``'s
modes); here one interpreter start per rank serves them all, and
``checks.run_checks`` reports each on its own line. The guards that end the job, or that are
about how it exits, stay in ``faults_suite`` jobs of their own.
"""
import sys

import async_suite
import collectives_suite
import faults_suite
from checks import run_suite

CHECKS = {
    **{f"collectives-{name}": check for name, check in collectives_suite.CHECKS.items()},
    **{f"async-{name}": check for name, check in async_suite.CHECKS.items()},
    "mismatch": faults_suite.mode_mismatch,
    "bad-args": faults_suite.mode_bad_args,
    "nested": faults_suite.mode_nested,
    "sync-twice": faults_suite.mode_sync_twice,
}


if __name__ == "__main__":
    sys.exit(run_suite(CHECKS))
