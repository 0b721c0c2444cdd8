"""The public surface: ``bagua_mpi.__all__`` names what users (and Horovod scripts) get."""
import bagua_mpi as bm

INTERNAL = {"runtime", "worker", "buffers", "consistency", "topology", "config", "faults",
            "watchdog", "collectives", "engine", "optimizer", "accounting", "timeline", "ops",
            "exceptions", "cuda", "backends"}


def test_every_public_name_exists():
    assert [n for n in bm.__all__ if not hasattr(bm, n)] == []
    assert len(bm.__all__) == len(set(bm.__all__))


def test_no_internal_module_is_public():
    assert not INTERNAL & set(bm.__all__)


def test_errors_share_one_root():
    for name in ("CommunicationError", "ConfigError", "MismatchError", "MisuseError",
                 "NestedAsyncError", "NotInitializedError", "UnsupportedOptionError",
                 "JoinedRankError", "HorovodInternalError"):
        assert issubclass(getattr(bm, name), bm.BaguaMPIError), name
