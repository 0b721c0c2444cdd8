"""The collectives, asynchronous handles and the misuse guards that leave the library working,
in one job per world size: ``python basics_suite.py --check NAME ...`` on every rank.

Each is the same check its own suite runs alone (``collectives_suite``, ``async_suite``,
``faults_suite``'s modes); here one interpreter start per rank serves them all, and
``checks.run_checks`` reports each on its own line. The guards that end the job, or that are
about how it exits, stay in ``faults_suite`` jobs of their own.
"""
import sys

import async_suite
import collectives_suite
import faults_suite
from checks import run_suite

CHECKS = {
    "collectives": collectives_suite.check_every_collective,
    "async": async_suite.check_every_handle_property,
    "mismatch": faults_suite.mode_mismatch,
    "bad-args": faults_suite.mode_bad_args,
    "nested": faults_suite.mode_nested,
    "sync-twice": faults_suite.mode_sync_twice,
}


if __name__ == "__main__":
    sys.exit(run_suite(CHECKS))
