"""Inspect checkpoints without MPI::

    python -m bagua_mpi.checkpoint verify ckpt/            # the file `latest` names
    python -m bagua_mpi.checkpoint verify ckpt/ckpt-0000000100.h5
    python -m bagua_mpi.checkpoint info ckpt/               # /meta as JSON (seal checked)
    python -m bagua_mpi.checkpoint list ckpt/

Exit status 0 when the file is sound, 1 with the reason on stderr when it is not.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from .errors import CheckpointError
from .inspection import read_meta, verify
from .rotation import latest, list_checkpoints, read_latest


def _resolve(path: str) -> str:
    if os.path.isdir(path):
        found = latest(path)
        if found is None:
            raise CheckpointError(f"no checkpoint in {path}")
        return found
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bagua_mpi.checkpoint",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["verify", "info", "list"])
    parser.add_argument("path", help="a checkpoint file or directory")
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            pointer = read_latest(args.path)
            for f in list_checkpoints(args.path):
                mark = " <- latest" if os.path.basename(f) == pointer else ""
                print(f"{f}  {os.path.getsize(f)} bytes{mark}")
            return 0
        path = _resolve(args.path)
        meta = verify(path) if args.command == "verify" else read_meta(path, verify=False)
    except (CheckpointError, OSError) as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if args.command == "verify":
        print(f"OK {path}: step {meta['step']}, {meta['world_size']} ranks, "
              f"scheme {meta['write_scheme']}")
    else:
        print(json.dumps(meta, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
