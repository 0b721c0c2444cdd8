"""Every exception class of bagua_mpi is reachable from ``bagua_mpi.exceptions`` and derives from
``BaguaMPIError``; numba_kernels' errors (a stand-alone package that must not import bagua_mpi)
are re-exported there too and derive from their own root, ``KernelError``. Warning classes are
reachable there too and are ``UserWarning``s (what ``warnings.filterwarnings`` users expect)."""
import importlib
import inspect
import pkgutil

import pytest

import bagua_mpi
import bagua_mpi.exceptions as exceptions
import numba_kernels.errors

# Modules that are scripts (``python -m``): importing them would run them.
SCRIPTS = {"__main__"}


def _modules(package):
    names = [package.__name__]
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if info.name.rsplit(".", 1)[-1] not in SCRIPTS:
            names.append(info.name)
    return names


def _defined_exceptions(package, warnings: bool = False):
    """(qualified name, class) of every public Exception subclass defined in ``package``'s
    modules, warnings or not. Private ones (``_NoWorkers``: control flow that never leaves its
    module) are left out."""
    found = {}
    for name in _modules(package):
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if (inspect.isclass(value) and issubclass(value, Exception)
                    and issubclass(value, Warning) == warnings
                    and value.__module__ == name and not attr.startswith("_")):
                found[f"{name}.{attr}"] = value
    return sorted(found.items())


BAGUA = [pytest.param(q, c, id=q) for q, c in _defined_exceptions(bagua_mpi)]
WARNINGS = [pytest.param(q, c, id=q) for q, c in _defined_exceptions(bagua_mpi, warnings=True)]
KERNELS = _defined_exceptions(numba_kernels)


def test_the_walk_finds_the_known_ones():
    names = {p.values[0].rsplit(".", 1)[-1] for p in BAGUA}
    assert {"BaguaMPIError", "CheckpointError", "JoinedRankError", "UnsupportedOptionError",
            "BackendError", "DistBeliefError", "HostsUpdatedInterrupt"} <= names
    assert {q.rsplit(".", 1)[-1] for q, _ in KERNELS} >= {"KernelError", "LayoutError"}


@pytest.mark.parametrize("qualname,cls", BAGUA)
def test_reexported_and_rooted_in_bagua_mpi_error(qualname, cls):
    assert getattr(exceptions, cls.__name__, None) is cls, \
        f"{qualname} is not re-exported from bagua_mpi.exceptions"
    assert cls.__name__ in exceptions.__all__
    assert issubclass(cls, exceptions.BaguaMPIError), f"{qualname} does not derive from " \
                                                       f"BaguaMPIError: {cls.__mro__}"


@pytest.mark.parametrize("qualname,cls", WARNINGS)
def test_warnings_reexported_and_user_warnings(qualname, cls):
    assert getattr(exceptions, cls.__name__, None) is cls, \
        f"{qualname} is not re-exported from bagua_mpi.exceptions"
    assert cls.__name__ in exceptions.__all__
    assert issubclass(cls, UserWarning), cls.__mro__


def test_the_walk_finds_the_warnings():
    assert {p.values[0].rsplit(".", 1)[-1] for p in WARNINGS} >= {"DiscardedExchangeWarning"}


@pytest.mark.parametrize("qualname,cls", KERNELS, ids=[q for q, _ in KERNELS])
def test_kernel_errors_reexported_with_their_own_root(qualname, cls):
    assert getattr(exceptions, cls.__name__, None) is cls, \
        f"{qualname} is not re-exported from bagua_mpi.exceptions"
    assert cls.__name__ in exceptions.__all__
    assert issubclass(cls, exceptions.KernelError) and issubclass(cls, RuntimeError)


def test_every_reexport_resolves():
    for name in exceptions.__all__:
        value = getattr(exceptions, name)
        assert inspect.isclass(value) and issubclass(value, Exception), name
