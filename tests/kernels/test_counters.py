"""The process-wide launch and allocation counters (the host side; counts per format: sim_launches.py)."""
import threading

import numba_kernels as nk
from numba_kernels import _counters


def test_counts_read_without_disturbing_and_reset_together():
    nk.reset_launch_count()
    assert (nk.launch_count(), nk.device_allocations()) == (0, 0)
    for _ in range(3):
        _counters.count_launch()
    _counters.count_allocation()
    assert (nk.launch_count(), nk.device_allocations()) == (3, 1)
    assert (nk.launch_count(), nk.device_allocations()) == (3, 1)      # reading takes nothing away
    _counters.count_launch()
    assert nk.launch_count() == 4
    nk.reset_launch_count()
    assert (nk.launch_count(), nk.device_allocations()) == (0, 0)


def test_concurrent_launches_are_all_counted():
    nk.reset_launch_count()
    threads, each = 8, 20000

    def bump():
        for _ in range(each):
            _counters.count_launch()

    workers = [threading.Thread(target=bump) for _ in range(threads)]
    for w in workers:
        w.start()
    for _ in range(100):                                        # reads interleaved with bumps
        nk.launch_count()
    for w in workers:
        w.join()
    assert nk.launch_count() == threads * each
    nk.reset_launch_count()
