"""Exceptions raised by numba_kernels.

Every error derives from ``KernelError`` (a ``RuntimeError``), so callers can
catch the package's failures in one clause.  Errors about a bad argument also
derive from ``ValueError`` or ``TypeError`` so that generic handlers keep working.
Messages name the argument and the offending value.
"""


class KernelError(RuntimeError):
    """Root of every error raised by numba_kernels."""


class KernelParameterError(KernelError, ValueError):
    """A compressor parameter is out of range (bits, chunk, k, levels, ...)."""


class KernelTypeError(KernelError, TypeError):
    """An input has a dtype or a type the kernels do not accept."""


class LayoutError(KernelError, ValueError):
    """An array is not contiguous, or its shape or size does not match."""


class PayloadError(KernelError, ValueError):
    """A payload buffer does not match its format (size, dtype, location)."""


class DeviceMismatchError(KernelError, ValueError):
    """Arrays that must live together are split between host and GPU."""


class CudaUnavailableError(KernelError):
    """Device data was given but numba.cuda cannot be used here."""


# Raised only under Numba's CUDA simulator, by the checks that stand in for a GPU's behaviour
# (``_simulator_warps``, ``_simulator_races``): each is a bug a GPU would show as a hang or as
# results that change from run to run.

class WarpDivergence(KernelError):
    """The lanes of a warp did not all make the same warp call (a GPU may hang)."""


class MemoryRace(KernelError):
    """Two threads accessed one element of shared or device memory with no barrier between
    them (in device memory: wrote different values)."""
