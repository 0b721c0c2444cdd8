"""``python -m bagua_mpi <command>``: the library's command line.

    python -m bagua_mpi doctor [--json]             # check this machine and launch
    mpiexec -n 4 python -m bagua_mpi doctor         # ...and the topology, with an allreduce test

Checkpoints have their own: ``python -m bagua_mpi.checkpoint``.
"""
from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bagua_mpi",
                                     description="bagua_mpi's command line.")
    commands = parser.add_subparsers(dest="command", metavar="command")
    commands.required = True  # argparse then names the valid commands in its usage error
    doctor = commands.add_parser(
        "doctor", help="check versions, MPI, GPUs, memory and (under mpiexec) the topology",
        description="Check what this machine and this launch give bagua_mpi; run it under "
                    "mpiexec/srun to check the topology and time an allreduce too. Exit "
                    "status 1 when any check FAILs.")
    doctor.add_argument("--json", action="store_true",
                        help="print a JSON list of {check, status, value, fix}")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)  # unknown command: usage on stderr, exit 2
    if args.command == "doctor":
        from . import doctor

        return doctor.run(as_json=args.json)
    raise AssertionError(f"unhandled command {args.command!r}")  # the parser allows no other


if __name__ == "__main__":
    sys.exit(main())
