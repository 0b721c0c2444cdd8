"""Buckets: groups of parameters communicated together, optionally flattened.

``plan_buckets`` groups parameters in a given order (the profiled order of gradient readiness)
by a byte budget, one open bucket per dtype and device (a bfloat16 model with float32 norms
alternates the two at every layer, and closing at each change made about two buckets a layer),
starting a new one of a kind when its budget is exceeded, and listing the buckets in the order
they complete; it never closes a bucket still under ``MIN_BUCKET_BYTES`` (1 MiB, or 1/16 of a
smaller budget): such a bucket's exchange costs a collective's latency and absorbs the ranks'
skew, which delays the next bucket by more than starting a few hundred KiB early gains. Measured
on a 1 Gbit link (MLP, fp16 wire): a lone 180 KB first bucket took 30-80 ms and held the 67 MB
bucket behind it for ~23 ms; joined to it, steps went 795 -> 757 ms at 2 ranks and 2378 -> 2253
ms at 4.

A ``Bucket`` with flattening owns one contiguous gradient buffer; each parameter's ``.grad`` is a
view into it, so autograd accumulates straight into the buffer and the algorithm communicates
one tensor per bucket. ``flatten_params()`` does the same for the parameters themselves
(``p.data`` becomes a view of one flat buffer) for algorithms that update the model. Each
parameter's range holds its elements in the parameter's memory order and the views have its
strides (``layout.py``: a ``channels_last`` parameter keeps a ``channels_last`` gradient); the
flat vectors of an unflattened bucket (``grad_vector``, ``param_vector``) follow the same order.
A complex parameter is laid out as its real view (``layout.real_geometry``) in a bucket of its
real dtype, two elements per complex element (first, at even offsets, with any real parameter
whose last dimension is 2, which a model may view as complex: ``in_pairs``); its
``.grad`` and ``.data`` are complex views of that range, and what the algorithms get
(``grad_views``, ``communication_tensors``, ``real_params``...) is real.

Sharded buckets (ZeRO, ``parts`` = n > 1) pad both flat buffers to n equal partitions of
``part`` elements (``grad_storage`` / ``param_storage``; the padding stays zero), so that rank
r's slice is ``[r * part, (r + 1) * part)`` and a reduce-scatter or an in-place allgather moves
equal blocks. ``release_grads()`` frees the gradient buffer once its slice has been taken (stage
2); the next gradient allocates it again.
"""
from __future__ import annotations

import torch

from ..buffers import empty_like
from ..layout import autograd_strides, memory_order, real_dtype, real_geometry, real_view


MIN_BUCKET_BYTES = 1 << 20


def plan_buckets(params: list[torch.Tensor], order: list[int], bucket_bytes: int) -> list[list[int]]:
    """Partition parameter indices, taken in ``order``, into buckets of about ``bucket_bytes``.

    A complex parameter shares a bucket with the real ones of its real dtype; each bucket lists
    the parameters held in pairs of real elements first (``in_pairs``), so their ranges start at
    even offsets (each spans an even number of real elements), which complex views need."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_bytes} bytes")
    floor = min(MIN_BUCKET_BYTES, bucket_bytes // 16)  # see the module docstring
    done: list[tuple[int, list[int]]] = []  # (position of its last parameter, indices)
    open_buckets: dict = {}  # (real dtype, device) -> [indices, bytes, last position]
    for position, i in enumerate(order):
        p = params[i]
        nbytes = p.numel() * p.element_size()
        kind = (real_dtype(p.dtype), p.device)
        current = open_buckets.get(kind)
        if current is not None and current[1] + nbytes > bucket_bytes and current[1] >= floor:
            done.append((current[2], current[0]))
            current = None
        if current is None:
            current = open_buckets[kind] = [[], 0, position]
        current[0].append(i)
        current[1] += nbytes
        current[2] = position
    done += [(last, indices) for indices, _, last in open_buckets.values()]
    # in the order they complete: a bucket is ready when its last parameter's gradient is
    done.sort(key=lambda bucket: bucket[0])
    return [_pairs_first(indices, params) for _, indices in done]


def in_pairs(p: torch.Tensor) -> bool:
    """Whether ``p`` is held as pairs of real elements that something views as complex: a
    complex parameter (the bucket's own views), or a real one whose last dimension is 2, which
    a model may view as complex in ``forward`` (``torch.view_as_complex``: a Fourier layer's
    weight written before complex parameters were accepted). Such a view needs an even storage
    offset, and ``flatten_params`` (ZeRO, the model-averaging algorithms) makes the parameter a
    view of the bucket's buffer at its offset."""
    return p.is_complex() or (p.is_floating_point() and p.dim() > 0 and p.shape[-1] == 2)


def _pairs_first(indices: list[int], params: list[torch.Tensor]) -> list[int]:
    return sorted(indices, key=lambda i: not in_pairs(params[i]))  # stable: else in order


class Bucket:
    """Parameters ``indices`` (into the wrapper's parameter list) communicated as one unit."""

    def __init__(self, index: int, indices: list[int], params: list[torch.Tensor],
                 names: list[str], flatten: bool, allocate=None, parts: int = 1):
        self.index = index
        self.indices = indices
        self.params = [params[i] for i in indices]
        self.names = [names[i] for i in indices]
        self.dtypes = [p.dtype for p in self.params]  # complex ones are held as real
        self.dtype = real_dtype(self.params[0].dtype)
        self.device = self.params[0].device
        # each parameter's layout in the flat buffers, fixed here (see the module docstring)
        self.strides = [autograd_strides(p) for p in self.params]
        self.shapes = [tuple(p.shape) for p in self.params]
        geometry = [real_geometry(p) for p in self.params]
        self.real_shapes = [shape for shape, _, _ in geometry]
        self.real_strides = [strides for _, strides, _ in geometry]
        self.real_numels = [numel for _, _, numel in geometry]
        self.numel = sum(self.real_numels)
        self.offsets = []
        offset = 0
        for numel in self.real_numels:
            self.offsets.append(offset)
            offset += numel
        self.parts = parts
        self.part = -(-self.numel // parts)  # partition length of a sharded bucket
        self.flat_grad = None  # the property: None, or the buffer (below)
        self.flat_param: torch.Tensor | None = None
        self.grad_storage: torch.Tensor | None = None  # flat_grad plus partition padding
        self.param_storage: torch.Tensor | None = None  # flat_param plus partition padding
        self.shared = None  # node_shared.SharedRows holding flat_grad, when it is shared
        self.released = False  # release_grads() freed the gradient buffer
        self.shard_grad: torch.Tensor | None = None  # stage 2: this rank's reduced slice
        if flatten:
            if allocate is not None:  # a row of node-shared memory (zeroed by the allocator)
                length = self.part * parts
                if length % 2 and any(in_pairs(p) for p in self.params):
                    length += 1  # rows of even length keep every row's pairs aligned
                self.shared = allocate(length)
                self.shared.used = self.numel  # the rest of the row is slice padding
                self.grad_storage = self.shared.tensor
                self.flat_grad = self.grad_storage[:self.numel]
                self.shared.on_free.append(self.privatize)
            else:
                self._allocate_grads()
            for k, p in enumerate(self.params):
                if p.grad is not None:
                    self.param_view(self.flat_grad, k).copy_(_dense(p.grad))
                p.grad = self.param_view(self.flat_grad, k)

    @property
    def flat_grad(self) -> torch.Tensor | None:
        """The flat gradient buffer (None without flattening, or once released)."""
        return self._flat_grad

    @flat_grad.setter
    def flat_grad(self, buffer: torch.Tensor | None) -> None:
        self._flat_grad = buffer
        self._layer_grads = None   # views of the buffer it replaces

    def layer_grads(self) -> list[torch.Tensor]:
        """Each parameter's range of the flat gradient buffer as a 1-D view, in the layout's
        order: made once a buffer and kept, the same list each call until the buffer is
        replaced (a caller may key what it plans on the list's identity)."""
        if self._layer_grads is None:
            flat = self.flat_grad
            self._layer_grads = [flat[start:start + numel]
                                 for start, numel in zip(self.offsets, self.real_numels)]
        return self._layer_grads

    def _allocate_grads(self) -> None:
        self.grad_storage = zeros(self.part * self.parts, self.dtype, self.device)
        self.flat_grad = self.grad_storage[:self.numel]
        self.released = False

    def release_grads(self) -> None:
        """Free the gradient buffer (ZeRO stage 2, once this rank's slice has been reduced):
        ``.grad`` becomes None; the next gradient allocates the buffer again."""
        for p in self.params:
            p.grad = None
        self.flat_grad = self.grad_storage = None
        self.released = True

    def shard_grad_buffer(self) -> torch.Tensor:
        """This rank's slice of the reduced gradient (ZeRO stage 2), ``part`` elements."""
        if self.shard_grad is None:
            self.shard_grad = zeros(self.part, self.dtype, self.device)
        return self.shard_grad

    def _ensure_grads(self) -> None:
        if self.released:
            self._allocate_grads()

    @property
    def grad_bytes(self) -> int:
        """Bytes of gradient buffer this bucket holds now (0 once released)."""
        storage = self.grad_storage
        return 0 if storage is None else storage.numel() * storage.element_size()

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def real_view(self, flat: torch.Tensor, k: int) -> torch.Tensor:
        """Parameter k's range of ``flat`` with the shape and memory layout of the parameter
        (of its real view, for a complex one)."""
        start = self.offsets[k]
        return flat[start:start + self.real_numels[k]].as_strided(self.real_shapes[k],
                                                                  self.real_strides[k])

    def param_view(self, flat: torch.Tensor, k: int) -> torch.Tensor:
        """Parameter k's range of ``flat`` as the parameter: its shape, memory layout and dtype
        (a complex parameter's range starts at an even offset: see ``plan_buckets``)."""
        view = self.real_view(flat, k)
        return torch.view_as_complex(view) if self.dtypes[k].is_complex else view

    def real_params(self) -> list[torch.Tensor]:
        """The parameters as the algorithms see them: real views of the complex ones."""
        return [real_view(p) for p in self.params]

    def absorb_grad(self, k: int) -> None:
        """Make parameter k's ``.grad`` the view into the flat buffer again, if it is not.

        A sparse gradient (``nn.Embedding(sparse=True)``) becomes dense here: buckets are
        communicated dense, as Horovod's ``sparse_as_dense=True`` does.

        ``zero_grad(set_to_none=True)`` (PyTorch's default) drops the view; autograd then hands
        the parameter a fresh gradient tensor, which is copied into the bucket here.
        """
        p = self.params[k]
        self._ensure_grads()
        if self.flat_grad is None:
            if p.grad is not None and p.grad.is_sparse:
                p.grad = p.grad.to_dense()
            return
        view = self.param_view(self.flat_grad, k)
        if p.grad is None:
            view.zero_()
        elif p.grad.is_sparse or p.grad.data_ptr() != view.data_ptr():
            view.copy_(_dense(p.grad))
        else:
            return
        p.grad = view

    def fill_missing_grads(self) -> list[int]:
        """Give parameters that got no gradient a zero gradient; return their positions."""
        missing = []
        self._ensure_grads()
        for k, p in enumerate(self.params):
            if p.grad is None:
                missing.append(k)
                if self.flat_grad is not None:
                    view = self.param_view(self.flat_grad, k)
                    view.zero_()
                    p.grad = view
                else:
                    p.grad = torch.zeros_like(p)
            else:
                self.absorb_grad(k)
        return missing

    def conversion(self, k: int) -> str | None:
        """How parameter k changed since the bucket was built (``"dtype float32 -> float64"``),
        or None: a model converted after wrapping has gradients its bucket cannot hold."""
        p = self.params[k]
        changes = [f"{what} {was} -> {now}" for what, was, now in (
            ("dtype", self.dtypes[k], p.dtype), ("device", self.device, p.device),
            ("shape", self.shapes[k], tuple(p.shape))) if was != now]
        return ", ".join(str(c).replace("torch.", "") for c in changes) or None

    def frozen_names(self) -> tuple[str, ...]:
        """The parameters frozen since wrapping (``requires_grad`` off): a rank that trains one
        of them while another has frozen it would step on half its gradient alone."""
        return tuple(n for n, p in zip(self.names, self.params) if not p.requires_grad)

    def segments(self) -> list[tuple[str, int]]:
        """(name, elements in the flat layout) of each parameter, in the order of the layout."""
        return list(zip(self.names, self.real_numels))

    def communication_segments(self) -> list[list[tuple[str, int]]]:
        """The parameters each of ``communication_tensors()`` covers, as ``segments()``."""
        if self.flat_grad is not None:
            return [self.segments()]
        return [[segment] for segment in self.segments()]

    def grad_views(self) -> list[torch.Tensor]:
        """Each parameter's gradient, real (views of the flat buffer when flattened)."""
        if self.flat_grad is not None:
            return [self.real_view(self.flat_grad, k) for k in range(len(self.params))]
        return [real_view(p.grad) for p in self.params]

    def grad_vector(self) -> torch.Tensor:
        """The bucket's gradients as one vector: the flat buffer itself, or a concatenation."""
        if self.flat_grad is not None:
            return self.flat_grad
        return torch.cat([_real_flat(memory_order(p.grad.detach(), p)) for p in self.params])

    def param_vector(self) -> torch.Tensor:
        """The bucket's parameters as one vector: the flat buffer itself, or a concatenation."""
        if self.flat_param is not None:
            return self.flat_param
        return torch.cat([_real_flat(memory_order(p.detach())) for p in self.params])

    def communication_tensors(self) -> list[torch.Tensor]:
        """What the algorithm communicates: the flat buffer, or each gradient (no flattening),
        real."""
        if self.flat_grad is not None:
            return [self.flat_grad]
        return [real_view(p.grad) for p in self.params]

    def zero_grads(self) -> None:
        self._ensure_grads()
        if self.flat_grad is not None:
            self.flat_grad.zero_()
            for k, p in enumerate(self.params):
                view = self.param_view(self.flat_grad, k)
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    p.grad = view
        else:
            for p in self.params:
                if p.grad is not None:
                    p.grad.zero_()

    def privatize(self) -> None:
        """Move the gradients out of node-shared memory into a private buffer (before the
        window is freed), keeping ``.grad`` views of it."""
        if self.shared is None:
            return
        old = self.flat_grad
        self._allocate_grads()
        self.flat_grad.copy_(old)
        self.shared.on_free.remove(self.privatize)  # the window (kept to shutdown) lets go
        self.shared = None
        for k, p in enumerate(self.params):
            if p.grad is not None and p.grad.data_ptr() == self.param_view(old, k).data_ptr():
                p.grad = self.param_view(self.flat_grad, k)

    def flatten_params(self) -> torch.Tensor:
        """Move the parameters into one contiguous buffer; ``p.data`` become views of it."""
        if self.flat_param is None:
            self.param_storage = zeros(self.part * self.parts, self.dtype, self.device)
            flat = self.param_storage[:self.numel]
            self._param_addresses = []
            for k, p in enumerate(self.params):
                view = self.param_view(flat, k)
                view.copy_(p.data)
                p.data = view
                self._param_addresses.append(view.data_ptr())
            self.flat_param = flat
        return self.flat_param

    def params_moved_out(self) -> list[int]:
        """Positions of the parameters whose ``.data`` is no longer their view of ``flat_param``
        (a cheap check: address and strides): the model was converted (``.to()``, ``.half()``,
        a memory format) or a parameter's data replaced after ``flatten_params``, and what the
        algorithm exchanges would no longer be the model."""
        if self.flat_param is None:
            return []
        return [k for k, (p, address) in enumerate(zip(self.params, self._param_addresses))
                if p.data_ptr() != address or p.stride() != self.strides[k]]

    def param_tensors(self) -> list[torch.Tensor]:
        """The parameters as the algorithm sees them: the flat buffer, or each tensor (real)."""
        if self.flat_param is not None:
            return [self.flat_param]
        return [real_view(p.data) for p in self.params]

    def __repr__(self) -> str:
        return f"Bucket({self.index}, {len(self.params)} tensors, {self.nbytes} bytes)"


def zeros(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed flat buffer; on the CPU a large one comes from NumPy (transparent huge pages,
    see ``buffers.empty_like``): MPI's copies and the optimizer's passes over it are faster."""
    return empty_like(torch.empty(0, dtype=dtype, device=device), shape=(numel,)).zero_()


def _dense(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_dense() if grad.is_sparse else grad


def _real_flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D tensor (complex: of its real view) as real elements, in memory order."""
    return real_view(t).reshape(-1)
