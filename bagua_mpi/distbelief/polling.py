"""Waiting for MPI without spinning on a core, for both halves of ``bagua_mpi.distbelief``.

Waiting is done by polling with a short sleep (``Backoff``) instead of blocking MPI calls: MPICH
busy-polls inside a blocking call, and a parameter server (or a partition waiting for its
neighbour's activations) that spins on a core shared with the ranks that compute -- the normal
case on a small machine -- steals the time they need.
"""
from __future__ import annotations

import time

# Start with short sleeps, double up to this cap while nothing arrives. The cap bounds the extra
# latency an idle rank adds to a request (and its CPU use while idle).
POLL_MIN_S = 20e-6
POLL_MAX_S = 250e-6


class Backoff:
    """Sleep a little longer each time nothing happened; start over after something did."""

    __slots__ = ("delay", "max_s")

    def __init__(self, max_s: float = POLL_MAX_S):
        self.max_s = max_s
        self.delay = 0.0

    def idle(self) -> None:
        if self.delay == 0.0:
            self.delay = POLL_MIN_S
            return  # first miss: poll again at once
        time.sleep(self.delay)
        self.delay = min(2 * self.delay, self.max_s)

    def reset(self) -> None:
        self.delay = 0.0
