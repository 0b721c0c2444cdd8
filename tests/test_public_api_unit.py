"""The public surface: ``bagua_mpi.__all__`` names what users (and Horovod scripts) get."""
import inspect
import subprocess
import sys

import pytest

import bagua_mpi as bm

INTERNAL = {"runtime", "worker", "buffers", "consistency", "topology", "config", "faults",
            "watchdog", "collectives", "engine", "optimizer", "accounting", "timeline", "ops",
            "exceptions", "cuda", "backends"}


def test_every_public_name_exists():
    assert [n for n in bm.__all__ if not hasattr(bm, n)] == []
    assert len(bm.__all__) == len(set(bm.__all__))


def test_no_internal_module_is_public():
    assert not INTERNAL & set(bm.__all__)


def _fresh(code: str) -> str:
    """What ``code`` prints in a fresh interpreter."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_importing_the_package_loads_nothing_heavy():
    """``import bagua_mpi`` must neither initialize MPI nor import torch or Numba; tools that
    need none of them (the checkpoint command line) start without them."""
    loaded = _fresh("import sys, bagua_mpi\n"
                    "print(*[m for m in ('mpi4py.MPI', 'torch', 'numba', 'h5py') "
                    "if m in sys.modules])")
    assert loaded == ""


def test_first_public_name_loads_every_public_name():
    count = _fresh("import bagua_mpi as bm\nbm.rank\n"
                   "print(sum(name in vars(bm) for name in bm.__all__), len(bm.__all__))")
    assert count.split()[0] == count.split()[1], count


def test_public_modules_are_the_modules_in_all():
    assert {n for n in bm.__all__ if inspect.ismodule(getattr(bm, n))} == bm._PUBLIC_MODULES


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no_such_thing"):
        bm.no_such_thing
    assert not hasattr(bm, "__wrapped__")


def test_the_registry_is_complete_without_the_package_api():
    """``import bagua_mpi.algorithms`` alone (the package's names untouched) registers every
    algorithm the whole package registers (L-GreCo, whose solver is a package of its own,
    included)."""
    alone = _fresh("import bagua_mpi.algorithms as a\nprint(a.names())")
    full = _fresh("import bagua_mpi as bm\nbm.DistributedOptimizer\n"
                  "print(bm.algorithms.names())")
    assert alone == full and "lgreco" in full


def test_lgreco_is_one_class_under_both_names():
    import bagua_mpi.lgreco
    assert bagua_mpi.lgreco.LGreCo is bm.algorithms.LGreCo
    assert bagua_mpi.lgreco.LGreCoImpl is bm.algorithms.LGreCoImpl


def test_errors_share_one_root():
    for name in ("CommunicationError", "ConfigError", "MismatchError", "MisuseError",
                 "NestedAsyncError", "NotInitializedError", "UnsupportedOptionError",
                 "JoinedRankError", "HorovodInternalError"):
        assert issubclass(getattr(bm, name), bm.BaguaMPIError), name


# -- the public face (docs/design.md): one DistributedOptimizer, Horovod's order, no guessing --
# What ``horovod.torch`` exports (Horovod 0.28, ``horovod/torch/__init__.py``): its functions,
# ops, classes and submodules.
HOROVOD_TORCH = {
    "init", "shutdown", "is_initialized", "size", "local_size", "cross_size", "rank",
    "local_rank", "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_enabled",
    "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built",
    "cuda_built", "rocm_built", "sycl_built", "start_timeline", "stop_timeline",
    "allreduce", "allreduce_async", "allreduce_", "allreduce_async_", "sparse_allreduce_async",
    "grouped_allreduce", "grouped_allreduce_async", "grouped_allreduce_",
    "grouped_allreduce_async_", "allgather", "allgather_async", "grouped_allgather",
    "grouped_allgather_async", "broadcast", "broadcast_async", "broadcast_", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "join", "barrier", "poll",
    "synchronize", "allgather_object", "broadcast_object", "broadcast_parameters",
    "broadcast_optimizer_state", "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "Compression", "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "DistributedOptimizer", "SyncBatchNorm", "elastic",
}
# horovod.torch names bagua_mpi does not offer (none today).
HOROVOD_UNSUPPORTED: set = set()
# What bagua_mpi.horovod adds: Horovod's exception names (horovod.common.exceptions), the
# node-level process sets, and mlsl_built (older Horovod releases).
HOROVOD_EXTRAS = {"HorovodInternalError", "HostsUpdatedInterrupt", "node_local_process_set",
                  "cross_node_process_set", "mlsl_built"}


def test_horovod_all_is_horovod_torch_as_far_as_supported():
    import bagua_mpi.horovod as hvd
    exported = set(hvd.__all__)
    assert len(hvd.__all__) == len(exported)
    assert HOROVOD_TORCH - HOROVOD_UNSUPPORTED - exported == set()
    assert exported - HOROVOD_TORCH == HOROVOD_EXTRAS
    assert [n for n in hvd.__all__ if not hasattr(hvd, n)] == []
    assert not {"runtime", "basics", "functions", "optimizer", "exceptions"} & exported


def test_horovod_names_are_at_the_top_level_and_imported_once():
    import bagua_mpi.horovod as hvd
    assert set(hvd.__all__) <= set(bm.__all__)
    # the four that exist in both a native and a Horovod form: the Horovod form (a superset)
    for name in ("init", "DistributedOptimizer", "broadcast_parameters",
                 "broadcast_optimizer_state"):
        assert getattr(bm, name) is getattr(hvd, name), name
    # one DistributedOptimizer: Horovod's signature over the native class
    from bagua_mpi import optimizer
    assert issubclass(bm.DistributedOptimizer, optimizer.DistributedOptimizer)
    import inspect
    params = list(inspect.signature(bm.DistributedOptimizer).parameters)
    assert params[:10] == ["optimizer", "named_parameters", "compression",
                           "backward_passes_per_step", "op", "gradient_predivide_factor",
                           "num_groups", "groups", "sparse_as_dense", "process_set"]


@pytest.fixture
def one_rank():
    bm.init(abort_on_exception=False)
    yield
    bm.shutdown()


def test_native_options_by_keyword(one_rank):
    import torch
    model = torch.nn.Linear(3, 2)
    opt = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  model.named_parameters(), bm.Compression.fp16,
                                  algorithm="decentralized")
    assert opt.algorithm.name == "decentralized" and opt.compression is bm.Compression.fp16
    opt.close()


def test_third_positional_is_compression_never_an_algorithm(one_rank):
    import torch
    model = torch.nn.Linear(3, 2)
    with pytest.raises(TypeError, match="algorithm="):
        bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                model.named_parameters(), "bytegrad")
