"""The CPU kernels' threads leave torch's thread count alone (``codecs.fit_kernel_threads``).

Numba starts its thread pool once per process, so each check runs in a fresh interpreter: a
thread plays the communication thread, which makes the process's first compression call.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

THREAD = textwrap.dedent("""
    import json, threading, torch
    torch.set_num_threads(1)
    seen = {{}}
    def communication_thread():
        seen["before"] = torch.get_num_threads()
        {start}
        seen["after"] = torch.get_num_threads()
        import numba
        seen["layer"] = numba.threading_layer()
        seen["numba_threads"] = numba.config.NUMBA_NUM_THREADS
    thread = threading.Thread(target=communication_thread)
    thread.start()
    thread.join()
    seen["main"] = torch.get_num_threads()
    print(json.dumps(seen))
""")


def _thread_counts(start: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", THREAD.format(start=start)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_starting_numba_threads_keeps_the_threads_torch_count():
    """The process's first ``fit_kernel_threads`` (which starts Numba's pool) leaves the
    calling thread's torch count at 1: torch's CPU work in the communication thread (PowerSGD's
    matrix products) otherwise ran with NUMBA_NUM_THREADS OpenMP threads."""
    seen = _thread_counts("from bagua_mpi.primitives import codecs; codecs.fit_kernel_threads()")
    assert (seen["before"], seen["after"], seen["main"]) == (1, 1, 1), seen


def test_numba_alone_changes_the_count_here():
    """Why the test above can fail: on this machine Numba's OpenMP layer, started directly,
    leaves the starting thread's torch count at NUMBA_NUM_THREADS."""
    seen = _thread_counts("import numba; numba.get_num_threads()")
    if seen["layer"] != "omp" or seen["numba_threads"] < 2:
        pytest.skip(f"Numba's threading layer here is {seen['layer']} with "
                    f"{seen['numba_threads']} thread(s): only OpenMP with 2+ changes the count")
    assert seen["after"] == seen["numba_threads"] and seen["before"] == 1, seen
