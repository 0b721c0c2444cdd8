"""Per-rank algorithm state that follows the parameters, not the buckets.

Error feedback, residuals, momenta, neighbour estimates, PowerSGD's Q: every piece of running
state belongs to a parameter. Algorithms hold it in whatever shape their exchange needs (one
vector per communicated tensor, padded to n partitions, or one tensor per layer), but they
allocate it here, so that

* a checkpoint stores it under ``kind -> parameter name``, whatever the bucketing was, and a
  job that buckets differently (another ``bucket_size_mb``, another profiled order) loads it;
* state loaded *before* the buckets exist (a restarted job loads its checkpoint before the first
  step) is held and applied when the algorithm allocates it, with no per-algorithm workaround;
* a checkpoint entry that no allocation claims is an error, not a silently dropped state.

Two shapes of state:

``vector(kind, key, segments, length, window)``
    One flat tensor laid over consecutive parameters ``segments`` = [(name, numel), ...] (a
    flattened bucket, or one parameter), ``length`` >= their total (padding to n equal
    partitions; the padding is not checkpointed, ``zero_padding()`` clears it before use so an
    interrupted run and a resumed one see the same bits). ``window`` = (lo, hi) keeps only
    positions [lo, hi) of it (a C_LP_S server keeps its own partition, not the whole vector).
    Checkpointed as one tensor of the parameter's numel per parameter the window touches
    (positions outside the window are zeros and load as nothing).
``tensor(kind, name, make)``
    Any tensor owned by one parameter (a PowerSGD Q of m x r): ``make()`` creates it, and a held
    checkpoint value of the same shape replaces its contents.

In memory a vector is keyed by ``names_key(segments)``, the names of the parameters it covers
(``AlgorithmImpl.tensor_state``), so its key follows its parameters, as its checkpoint does.
"""
from __future__ import annotations

import itertools
from typing import Callable

import torch


def names_key(segments: list[tuple[str, int]]) -> str:
    """The names of the parameters a tensor covers (``Bucket.segments()`` form) as one string:
    what per-tensor state is keyed by, and a ``call_seed`` part. It follows the parameters, not
    the bucket's position, so another bucketing finds the same state and the same random stream
    wherever the tensor is the same."""
    return "\n".join(name for name, _ in segments)


class StateVector:
    """A flat state tensor over consecutive parameters (see the module docstring)."""

    def __init__(self, kind: str, segments: list[tuple[str, int]], length: int,
                 window: tuple[int, int] | None, device, dtype):
        self.kind = kind
        self.segments = segments
        self.total = sum(n for _, n in segments)
        if length < self.total:
            raise ValueError(f"state vector {kind!r} of {length} elements cannot hold "
                             f"{self.total} parameter elements")
        self.lo, self.hi = window if window is not None else (0, length)
        self.data = torch.zeros(self.hi - self.lo, dtype=dtype, device=device)

    def zero_padding(self) -> None:
        """Clear positions past the parameters (partition padding): never checkpointed."""
        if self.hi > self.total:
            self.data[max(0, self.total - self.lo):].zero_()

    def _overlaps(self):
        """(name, start in the parameter, start in ``data``, count) for each touched parameter."""
        start = 0
        for name, numel in self.segments:
            lo, hi = max(start, self.lo), min(start + numel, self.hi)
            if lo < hi:
                yield name, numel, lo - start, lo - self.lo, hi - lo
            start += numel

    def names(self) -> list[str]:
        return [name for name, *_ in self._overlaps()]

    def export(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, numel, p0, d0, count in self._overlaps():
            part = self.data[d0:d0 + count].detach()
            if count == numel:  # the whole parameter (all but a server's partition edges)
                out[name] = part.to("cpu", copy=True)
                continue
            full = torch.zeros(numel, dtype=self.data.dtype)
            full[p0:p0 + count] = part.cpu()
            out[name] = full
        return out

    def fill(self, name: str, value: torch.Tensor) -> None:
        for n, numel, p0, d0, count in self._overlaps():
            if n != name:
                continue
            flat = value.reshape(-1)
            if flat.numel() != numel:
                raise ValueError(f"checkpoint {self.kind!r} state of {name} has {flat.numel()} "
                                 f"elements, the parameter has {numel}")
            self.data[d0:d0 + count].copy_(flat[p0:p0 + count])


class AlgorithmState:
    """All per-rank tensors of one algorithm, addressable by (kind, parameter name)."""

    def __init__(self, param_numels: dict[str, int], param_strides: dict | None = None):
        self.param_numels = dict(param_numels)
        # name -> strides of the parameters whose state is not in row-major order (layout.py)
        self.param_strides = {n: tuple(s) for n, s in (param_strides or {}).items()}
        self.vectors: dict[tuple, StateVector] = {}  # (kind, key) -> vector
        self.tensors: dict[str, dict[str, torch.Tensor]] = {}  # kind -> name -> tensor
        self.pending: dict[str, dict[str, torch.Tensor]] = {}  # loaded, not yet allocated
        # (kind, group) -> (memory, {name: start}, {name: length}): see tensor_in_group
        self.groups: dict[tuple, tuple] = {}
        # counts the changes to which per-parameter tensors the state holds (not to their
        # values): whoever keeps views of them across steps compares it (kept_plan in base)
        self.generation = 0

    # -- allocation ---------------------------------------------------------------------------
    def vector(self, kind: str, key, segments: list[tuple[str, int]], length: int | None = None,
               window: tuple[int, int] | None = None, device="cpu",
               dtype=torch.float32) -> StateVector:
        """The vector ``(kind, key)``, created (zeros, or the held checkpoint values) once."""
        found = self.vectors.get((kind, key))
        if found is not None:
            return found
        total = sum(n for _, n in segments)
        vec = StateVector(kind, segments, total if length is None else length, window, device,
                          dtype)
        held = self.pending.get(kind, {})
        for name, _ in segments:
            if name in held:
                vec.fill(name, held.pop(name))
        self.vectors[(kind, key)] = vec
        return vec

    def tensor(self, kind: str, name: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The tensor of ``kind`` owned by parameter ``name``, created by ``make()`` once."""
        by_name = self.tensors.setdefault(kind, {})
        if name not in by_name:
            t = make()
            held = self.pending.get(kind, {}).pop(name, None)
            if held is not None:
                if tuple(held.shape) != tuple(t.shape):
                    raise ValueError(f"checkpoint {kind!r} state of {name} has shape "
                                     f"{tuple(held.shape)}, this run needs {tuple(t.shape)} "
                                     f"(other hyperparameters or world size?)")
                t.copy_(held)
            by_name[name] = t
            self.generation += 1
        return by_name[name]

    def made(self, kind: str, name: str) -> torch.Tensor | None:
        """The tensor of ``kind`` owned by ``name`` if it has been made, else None: a lookup
        that builds nothing, for callers that ask every step."""
        return self.tensors.get(kind, {}).get(name)

    def tensor_in_group(self, kind: str, name: str, group, lengths: Callable[[], dict],
                        device, shape: tuple | None = None,
                        initial: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
        """The float32 tensor of ``kind`` owned by ``name``, as ``tensor`` makes it (zeros, or
        ``initial()`` where given, or the held checkpoint values), but a slice of one memory
        that the tensors of a group of parameters share end to end (``group``: a key;
        ``lengths()``: {name: elements} of its members, in order; a key names one set of
        lengths), viewed as ``shape`` where given, so that an exchange can take the whole
        group as one array, or as one batch of matrices."""
        found = self.made(kind, name)
        if found is not None:
            return found
        memory = self.groups.get((kind, group))
        if memory is None:
            sizes = lengths()
            starts = dict(zip(sizes, itertools.accumulate(sizes.values(), initial=0)))
            memory = self.groups[(kind, group)] = (
                torch.zeros(sum(sizes.values()), dtype=torch.float32, device=device), starts,
                sizes)
        whole, starts, sizes = memory

        def make():
            mine = whole[starts[name]:starts[name] + sizes[name]]
            mine = mine if shape is None else mine.view(shape)
            return mine.zero_() if initial is None else mine.copy_(initial())
        return self.tensor(kind, name, make)

    def forget_skipped_step(self, zeroed_kinds, restarted_kinds=()) -> list[str]:
        """After a step was skipped because its gradients held inf or NaN (as
        ``torch.amp.GradScaler`` skips them), drop what those gradients already left in the
        state: every tensor of ``zeroed_kinds`` becomes 0 (an error-feedback memory restarts
        empty), and those of ``restarted_kinds`` are dropped, to be made afresh at their next
        use (PowerSGD's warm-started Q, the same on every rank). The whole of them, not only
        their non-finite entries: an overflowing gradient also leaves huge finite values.
        Returns the kinds it dropped, in the order given."""
        dropped = set()
        for (kind, _), vec in self.vectors.items():
            if kind in zeroed_kinds:
                vec.data.zero_()
                dropped.add(kind)
        for kind, by_name in list(self.tensors.items()):
            if by_name and kind in zeroed_kinds:
                for t in by_name.values():
                    t.zero_()
                dropped.add(kind)
            elif by_name and kind in restarted_kinds:
                self.tensors[kind] = {}
                self.generation += 1
                dropped.add(kind)
        return [kind for kind in (*zeroed_kinds, *restarted_kinds) if kind in dropped]

    def clear(self) -> None:
        """Back to a fresh run's state: every vector zeroed in place (whoever holds it keeps
        it), per-parameter tensors and held checkpoint values dropped (``tensor`` makes them
        afresh at their next use, as the first step did, a group's in a new memory)."""
        for vec in self.vectors.values():
            vec.data.zero_()
        self.tensors = {}
        self.pending = {}
        self.groups = {}
        self.generation += 1

    def drop(self, kind: str) -> None:
        """Forget every allocation of ``kind`` (a stage change that restarts that state)."""
        self.vectors = {k: v for k, v in self.vectors.items() if k[0] != kind}
        self.tensors.pop(kind, None)
        self.groups = {k: v for k, v in self.groups.items() if k[0] != kind}
        self.generation += 1

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        out: dict[str, dict[str, torch.Tensor]] = {}
        for (kind, _), vec in self.vectors.items():
            out.setdefault(kind, {}).update(vec.export())
        for kind, by_name in self.tensors.items():
            out.setdefault(kind, {}).update({n: t.detach().cpu().clone()
                                             for n, t in by_name.items()})
        for kind, held in self.pending.items():  # loaded but not allocated yet: keep it
            for name, value in held.items():
                out.setdefault(kind, {}).setdefault(name, value.clone())
        return out

    def layouts(self) -> dict[str, list[int]]:
        """What a checkpoint records of the layouts: the strides of every parameter whose state
        is not in row-major order."""
        return {name: list(strides) for name, strides in self.param_strides.items()}

    def check_layouts(self, state: dict, saved: dict) -> None:
        """Raise unless every parameter with state in ``state`` had, when it was saved, the
        memory layout it has now (``saved``: its ``layouts()``; absent means row-major, as in
        every file written before layouts were recorded). State is stored in the parameters'
        memory order, and a server's partition or PowerSGD's Q cannot be re-laid out alone."""
        for kind, by_name in state.items():
            for name in by_name:
                then = tuple(saved.get(name, ()))
                now = self.param_strides.get(name, ())
                if then != now:
                    raise ValueError(
                        f"checkpoint {kind!r} state of {name} was saved with the parameter laid "
                        f"out {_layout_words(then)}, and it is {_layout_words(now)} now: "
                        f"algorithm state is kept in the parameters' memory order. Convert the "
                        f"model to the memory format it had then (model.to(memory_format=...)) "
                        f"before wrapping it, or load with reset_algorithm_state=True")

    def load_state_dict(self, state: dict) -> None:
        """Replace the state by ``state``: what is allocated now takes its values, the rest is
        held until it is allocated. State of kinds and parameters that ``state`` lacks restarts
        as a fresh run's would (``clear``), so loading into an optimizer that has stepped
        (an elastic restore, a roll-back to an earlier checkpoint) leaves nothing of its own.
        Every entry is checked against what is allocated first: a state that does not fit
        raises ``ValueError`` and changes nothing."""
        for kind, by_name in state.items():
            for name, value in by_name.items():
                self._check_fits(kind, name, value)
        self.clear()
        for kind, by_name in state.items():
            for name, value in by_name.items():
                self._apply(kind, name, value)

    def _check_fits(self, kind: str, name: str, value: torch.Tensor) -> None:
        if name not in self.param_numels:
            raise ValueError(f"checkpoint has {kind!r} state for parameter {name!r}, "
                             f"which this model does not have")
        for (k, _), vec in self.vectors.items():
            if k == kind and name in vec.names() and value.numel() != self.param_numels[name]:
                raise ValueError(f"checkpoint {kind!r} state of {name} has {value.numel()} "
                                 f"elements, the parameter has {self.param_numels[name]}")
        target = self.tensors.get(kind, {}).get(name)
        if target is not None and tuple(value.shape) != tuple(target.shape):
            raise ValueError(f"checkpoint {kind!r} state of {name} has shape "
                             f"{tuple(value.shape)}, this run needs {tuple(target.shape)}")

    def _apply(self, kind: str, name: str, value: torch.Tensor) -> None:
        """After ``clear``: into the vectors allocated now, else held (per-parameter tensors
        are made afresh at their next use, and take it then)."""
        placed = False
        for (k, _), vec in self.vectors.items():
            if k == kind and name in vec.names():
                vec.fill(name, value)
                placed = True
        if not placed:
            self.pending.setdefault(kind, {})[name] = value

    def check_claimed(self) -> None:
        """Raise if held checkpoint state was not claimed by any allocation.

        A vector whose window (a server partition) skips a parameter claims nothing for it, so
        entries of kinds that are allocated at all are dropped, not refused, when unclaimed:
        their positions now belong to another rank's partition.
        """
        allocated = {k for k, _ in self.vectors} | set(self.tensors)
        unclaimed = {}
        for kind, held in list(self.pending.items()):
            if kind in allocated:
                del self.pending[kind]
                continue
            if held:
                unclaimed[kind] = sorted(held)
        if unclaimed:
            detail = "; ".join(f"{kind}: {', '.join(names[:3])}"
                               + (f" and {len(names) - 3} more" if len(names) > 3 else "")
                               for kind, names in unclaimed.items())
            raise ValueError(f"checkpoint has algorithm state this configuration does not use "
                             f"({detail}): other hyperparameters than the saved run?")


def _layout_words(strides: tuple) -> str:
    return f"with strides {tuple(strides)}" if strides else "row-major"
