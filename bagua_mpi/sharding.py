"""ZeRO: the wrapped optimizer's state (stage 1) and the gradients (stage 2) sharded over the ranks.

Every bucket's flat layout is padded to n equal partitions of ``part`` elements; rank r owns
``[r * part, (r + 1) * part)`` of every bucket (the last ranks' slices may be short or empty:
uneven slices are padding, never data).

A step at stage 1:

1. the algorithm synchronizes the bucket's whole gradient as at stage 0 (allreduce, C_LP_S...);
2. an optimizer of the user's class, built over *pieces* (1-D views of the flat parameters, one
   per parameter this rank's slice touches, in the user's param groups and with their
   hyperparameters), updates this rank's slice only: its state is 1/n of the full state;
3. every bucket's parameters are all-gathered in place, so every rank holds the whole model.

Stage 2 replaces step 1 with a reduce-scatter (``AlgorithmImpl.reduce_scatter_bucket``, on the
communication thread while backward runs): each rank receives only its slice of the reduced
gradient (``bucket.shard_grad``) and the bucket's full gradient buffer is freed after it, so
between steps a rank holds 1/n of the gradients. ``p.grad`` is then ``None`` after
``synchronize()``; ``clip_grad_norm_`` on the wrapper clips from the slices.

The optimizer must update parameters elementwise (SGD, Adam, AdamW, RMSprop, Adagrad...): a
slice's update may not depend on the rest of the tensor. Those whose step needs whole tensors
are refused by name, and a step from outside torch.optim's elementwise optimizers unless the
user declares it elementwise (``zero_elementwise=True``); a state entry shaped otherwise than
its piece is refused when met.

A complex parameter lies in its bucket as its real view, so its pieces are real and a slice may
end between the real and imaginary parts of one element. That is the update torch.optim's
optimizers make anyway (each reads a complex tensor as its real view, elementwise), so those
are accepted; an optimizer whose ``step`` comes from elsewhere is refused with complex
parameters. The logical state of a complex parameter is complex, as the unsharded optimizer's.

Checkpoints: ``state_dict()`` gathers the *logical* state, exactly what the unsharded optimizer
would hold (one tensor per parameter and state entry, numbered as torch numbers parameters), so
a file does not depend on the world size or the stage, and ``load_state_dict`` takes any such
state and keeps this rank's slices.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from mpi4py import MPI

from . import consistency, optimizer_hooks, runtime
from .algorithms.base import UnsupportedOptionError
from .layout import memory_order, real_view
from .transport import Transport

STAGES = (0, 1, 2)

# optimizers whose update of an element needs more than that element's own history
WHOLE_TENSOR_OPTIMIZERS = {
    "LBFGS": "its step is a line search over the whole model (closures, global directions)",
    "Adafactor": "it factors second moments over the rows and columns of whole matrices",
    "Muon": "it orthogonalizes the update of whole matrices",
    "Shampoo": "its preconditioners are built from whole matrices",
    "DistributedShampoo": "its preconditioners are built from whole matrices",
    "SparseAdam": "it takes sparse gradients, which sharded buckets do not hold",
}


# torch.optim's optimizers whose step updates each element from that element's own state
# (and per-tensor scalars that depend only on the step count), so a slice steps as it would
# inside the whole tensor
ELEMENTWISE_TORCH_OPTIMIZERS = frozenset({
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop", "Adagrad",
    "Adadelta", "ASGD"})


def check_optimizer(optimizer: torch.optim.Optimizer, stage: int,
                    declared_elementwise: bool = False) -> None:
    """Refuse an optimizer that cannot update a slice of a tensor on its own.

    1. One known to need whole tensors (a line search, factored or matrix preconditioners):
       refused with the reason.
    2. Complex parameters with a ``step`` from outside torch.optim: refused (it may update a
       complex element as a whole, which a slice can cut in two).
    3. A ``step`` from outside torch.optim's elementwise optimizers (a third-party or
       subclass's step): refused unless the user declares it elementwise
       (``zero_elementwise=True``). LAMB's and LARS's trust ratios, Prodigy's and
       D-Adaptation's step sizes are norms or sums over whole tensors or the whole model; on a
       slice they come out differently on every rank, and nothing would say so."""
    for cls in type(optimizer).__mro__:
        reason = WHOLE_TENSOR_OPTIMIZERS.get(cls.__name__)
        if reason is not None:
            raise UnsupportedOptionError(
                f"zero_stage={stage} is not supported with {type(optimizer).__name__}: {reason}; "
                f"sharding needs an optimizer that updates parameters elementwise (SGD, Adam, "
                f"AdamW, RMSprop, Adagrad, ...); use zero_stage=0")
    # the function itself, under the wrappers torch puts on a class's step when it is first
    # instantiated (they keep its module and name, and may sit on a subclass)
    step = inspect.unwrap(type(optimizer).step)
    step_module = getattr(step, "__module__", None) or "?"
    step_from = f"{step_module}.{getattr(step, '__qualname__', '?')}"
    from_torch = (step_module.startswith("torch.optim.")
                  and step_from.rsplit(".", 2)[-2] in ELEMENTWISE_TORCH_OPTIMIZERS)
    complex_shapes = [tuple(p.shape) for group in optimizer.param_groups for p in group["params"]
                      if p.is_complex()]
    if complex_shapes and not from_torch:
        raise UnsupportedOptionError(
            f"zero_stage={stage} with complex parameters ({len(complex_shapes)} of them, the "
            f"first of shape {complex_shapes[0]}) needs an optimizer whose step updates a "
            f"complex tensor as its real view, elementwise, as torch.optim's do: a rank's slice "
            f"may end inside a complex element, and its real and imaginary parts are then "
            f"updated on two ranks. {type(optimizer).__name__}'s step is {step_from!r}, "
            f"which may update a complex element as a whole; use zero_stage=0, which trains "
            f"them with any optimizer")
    if not from_torch and not declared_elementwise:
        raise UnsupportedOptionError(
            f"zero_stage={stage} with {type(optimizer).__name__}: its step is {step_from!r}, "
            f"not one of torch.optim's elementwise optimizers "
            f"({', '.join(sorted(ELEMENTWISE_TORCH_OPTIMIZERS))}). Each rank steps only its "
            f"slice of every tensor, which gives the unsharded result only if the step updates "
            f"each element from that element's own state. If this optimizer does (Lion, "
            f"signSGD), pass zero_elementwise=True; if it takes norms or sums over whole "
            f"tensors or the model (LAMB, LARS, Prodigy, D-Adaptation), use zero_stage=0")


def shard_index(topo, hierarchical: bool) -> int:
    """Which of the n slices of every bucket this rank owns: its rank, or with the two-level
    exchange local_rank * M + node (M nodes), so that the ranks of one local rank (one a node)
    own a contiguous block of slices and each level's reduce-scatter and allgather moves
    contiguous blocks."""
    return topo.local_rank * topo.cross_size + topo.cross_rank if hierarchical else topo.rank


def check_uniform_nodes(topo, stage: int) -> None:
    """Two-level sharding needs every node to hold the same number of ranks (collective)."""
    uniform = topo.local_size * topo.cross_size == topo.size
    everywhere = runtime.get().worker.run(lambda: topo.comm.allreduce(uniform, op=MPI.LAND),
                                          ("zero nodes uniform",))
    if not everywhere:
        raise UnsupportedOptionError(
            f"zero_stage={stage} with hierarchical=True needs the same number of ranks on every "
            f"node (rank {topo.rank}: {topo.local_size} ranks on its node, {topo.cross_size} "
            f"nodes, {topo.size} ranks); use hierarchical=False")


@dataclass
class Piece:
    """The part of one parameter inside this rank's slice of a bucket."""

    position: int  # the parameter's number in the user's optimizer (its state_dict key)
    bucket: object  # engine.buckets.Bucket
    start: int  # in the bucket's flat layout
    stop: int
    offset: int  # where the piece starts in the parameter's flattened elements
    group: int  # the user's param group
    tensor: torch.Tensor  # 1-D view of the bucket's flat parameters [start, stop)


class ShardedOptimizer:
    """The user's optimizer, run on this rank's slices (see the module docstring).

    ``user`` keeps the param groups the user (and LR schedulers) read and write; before each
    step their hyperparameters are copied to the inner optimizer, which holds the state."""

    def __init__(self, user: torch.optim.Optimizer, stage: int, topo, backend: str | None,
                 hierarchical: bool = False, stats=None):
        self.user = user
        self.stage = stage
        self.topo = topo
        self.backend = backend
        self.hierarchical = hierarchical
        self.rank, self.size = topo.rank, topo.size
        self.index = shard_index(topo, hierarchical)  # which slice of every bucket is ours
        self.stats = stats  # accounting.WireStats: the parameter allgathers' bytes
        params = [p for g in user.param_groups for p in g["params"]]
        self.position = {id(p): i for i, p in enumerate(params)}
        self.group_of = {id(p): gi for gi, g in enumerate(user.param_groups) for p in g["params"]}
        self.params = params
        self.buckets: list = []
        self.pieces: list[Piece] = []
        self.inner: torch.optim.Optimizer | None = None
        self._held: dict | None = None  # logical state loaded before the buckets existed

    # -- set-up ------------------------------------------------------------------------------
    def attach(self, buckets: list) -> None:
        """Once the buckets exist: flatten their parameters, cut this rank's pieces and build
        the inner optimizer (applying state loaded earlier)."""
        self.buckets = buckets
        for bucket in buckets:
            flat = bucket.flatten_params()
            lo = self.index * bucket.part
            hi = min(lo + bucket.part, bucket.numel)
            # in real elements: a complex parameter's piece is of its real view (the inner
            # optimizer updates it as torch.optim updates a complex tensor: as real pairs)
            for param, offset, numel in zip(bucket.params, bucket.offsets, bucket.real_numels):
                start, stop = max(offset, lo), min(offset + numel, hi)
                if start < stop:
                    self.pieces.append(Piece(self.position[id(param)], bucket, start, stop,
                                             start - offset, self.group_of[id(param)],
                                             flat[start:stop]))
        groups = []
        for gi, group in enumerate(self.user.param_groups):
            hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
            groups.append({**hyper, "params": [pc.tensor for pc in self.pieces if pc.group == gi]})
        try:
            self.inner = type(self.user)(groups)
        except TypeError:  # a class whose constructor needs its defaults spelled out
            try:
                self.inner = type(self.user)(groups, **self.user.defaults)
            except TypeError as exc:
                raise UnsupportedOptionError(
                    f"zero_stage={self.stage}: sharding builds a second "
                    f"{type(self.user).__name__} over this rank's slices, as "
                    f"{type(self.user).__name__}(param_groups) or with its defaults as "
                    f"keywords, and both failed ({exc}); give the constructor's other "
                    f"arguments defaults, or use zero_stage=0") from exc
        for pc in self.pieces:  # views of buffers that live as long as the buckets
            pc.tensor.grad = self._grad_of(pc)
        if self._held is not None:
            self._apply(self._held)
            self._held = None

    # -- the step ----------------------------------------------------------------------------
    def step(self, closure=None):
        """The user's optimizer's step, run on this rank's slices: its step hooks and LR
        schedulers see it step, though its own ``step`` is not called."""
        return optimizer_hooks.step_in_place_of(self.user, self._step, closure)

    def _step(self, _user, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for user_group, group in zip(self.user.param_groups, self.inner.param_groups):
            for key, value in user_group.items():  # LR schedulers write the user's groups
                if key not in ("params", "param_names"):
                    group[key] = value
        for pc in self.pieces:  # a piece of a parameter frozen since wrapping: no gradient
            trains = self.params[pc.position].requires_grad
            if trains != (pc.tensor.grad is not None):
                pc.tensor.grad = self._grad_of(pc) if trains else None
        self.inner.step()
        self._allgather_params()
        return loss

    def _grad_of(self, pc: Piece) -> torch.Tensor:
        bucket = pc.bucket
        if self.stage == 2:
            lo = self.index * bucket.part
            return bucket.shard_grad_buffer()[pc.start - lo:pc.stop - lo]
        return bucket.flat_grad[pc.start:pc.stop]

    def _allgather_params(self) -> None:
        def gather():
            for bucket in self.buckets:
                self._allgather_slices(bucket.param_storage, bucket.part)
                if self.stats is not None:  # this rank's slice to each of the n - 1 others
                    self.stats.add((self.size - 1) * bucket.part
                                   * bucket.param_storage.element_size())
        runtime.get().worker.run(gather, ("zero allgather", len(self.buckets)))

    def _allgather_slices(self, storage: torch.Tensor, part: int) -> None:
        """Communication thread: every rank's slice of ``storage`` (n slices of ``part``) to
        every rank, in place. Hierarchical: across the nodes first (local rank l gathers the
        node block [l*M, (l+1)*M) of slices), then the blocks inside the node."""
        topo = self.topo
        if not self.hierarchical:
            Transport(topo.comm, self.backend).allgather(
                storage[self.index * part:(self.index + 1) * part], storage)
            return
        block = part * topo.cross_size
        node_block = storage[topo.local_rank * block:(topo.local_rank + 1) * block]
        Transport(topo.inter, self.backend).allgather(
            storage[self.index * part:(self.index + 1) * part], node_block)
        Transport(topo.intra, self.backend).allgather(node_block, storage)

    # -- gradients ---------------------------------------------------------------------------
    def grad_slices(self) -> list[torch.Tensor]:
        """This rank's slices of the synchronized gradient (after ``synchronize()``)."""
        return [self._grad_of(pc) for pc in self.pieces]

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model, from the slices: each rank
        reduces its slices to one number and one allreduce combines them (float64)."""
        slices = [s for s in self.grad_slices() if s.numel()]
        norm_type = float(norm_type)
        # one number per rank, read from the device once (not once per slice)
        if norm_type == float("inf"):
            local = float(torch.stack([s.abs().max() for s in slices]).max()) if slices else 0.0
            op = MPI.MAX
        else:
            local = float(torch.stack([s.double().abs().pow(norm_type).sum()
                                       for s in slices]).sum()) if slices else 0.0
            op = MPI.SUM
        total = runtime.get().worker.run(lambda: self.topo.comm.allreduce(local, op=op),
                                         ("zero grad norm",))
        norm = total if norm_type == float("inf") else total ** (1.0 / norm_type)
        factor = float(max_norm) / (norm + 1e-6)
        if factor < 1.0:
            if self.stage == 2:
                for s in slices:
                    s.mul_(factor)
            else:  # the whole gradient is here: keep p.grad consistent
                for bucket in self.buckets:
                    bucket.flat_grad.mul_(factor)
        return torch.tensor(norm, dtype=torch.float32)

    def loss_scaler_groups(self) -> list[dict]:
        """What ``torch.amp.GradScaler`` reads at stage 2, where ``p.grad`` is None: groups of
        this rank's pieces, whose gradients are its slices of the reduced gradient (the scaler
        unscales them in place and checks them), and one more group holding a sentinel whose
        one-element gradient is inf when any rank's slices hold inf or NaN (one flag, one
        8-byte allreduce). The slices differ across the ranks, and a rank whose scaler stepped
        while another's skipped would wait for it in the parameters' allgather; with the
        sentinel every rank skips the same steps, and a rank without slices still has a
        gradient for the scaler to check."""
        # one check per bucket, over this rank's whole slice (its padding is zeros), and one
        # read from the device
        slices = [bucket.shard_grad_buffer() for bucket in self.buckets]
        device = self.buckets[0].device if self.buckets else torch.device("cpu")
        local = (not bool(torch.stack([s.isfinite().all() for s in slices]).all())
                 if slices else False)
        anywhere = runtime.get().worker.run(
            lambda: self.topo.comm.allreduce(int(local), op=MPI.MAX), ("zero inf check",))
        sentinel = torch.zeros(1, device=device)
        sentinel.grad = torch.full((1,), float("inf") if anywhere else 0.0, device=device)
        return [*self.inner.param_groups, {"params": [sentinel]}]

    # -- memory ------------------------------------------------------------------------------
    def state_bytes(self) -> int:
        """Bytes of optimizer state tensors this rank holds."""
        states = list(self.inner.state.values()) if self.inner is not None else []
        return sum(v.numel() * v.element_size() for s in states for v in s.values()
                   if torch.is_tensor(v))

    # -- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The logical (unsharded) state dict, its tensors in host memory: the same on every
        rank; collective."""
        groups = self.user.state_dict()["param_groups"]
        if self.inner is None:  # before the first step: nothing sharded yet
            held = self._held or {}
            return {"state": dict(held.get("state", {})), "param_groups": groups}
        mine = {}  # position -> {key: ("tensor", dtype) | ("value", v)}
        for pc, piece_state in self._piece_states():
            entry = mine.setdefault(pc.position, {})
            for key, value in piece_state.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    if value.numel() != pc.stop - pc.start:
                        raise UnsupportedOptionError(
                            f"zero_stage={self.stage}: {type(self.user).__name__} keeps state "
                            f"{key!r} of shape {tuple(value.shape)} for a slice of "
                            f"{pc.stop - pc.start} elements: it does not update parameters "
                            f"elementwise; use zero_stage=0")
                    entry[key] = ("tensor", str(value.dtype))
                else:
                    # a 0-d tensor goes to the others in an MPI message: as a host tensor, or
                    # it would be rebuilt on the sender's GPU index (Adam's fused ``step``)
                    entry[key] = ("value", value.detach().to("cpu", copy=True)
                                  if torch.is_tensor(value) else value)
        def gather_layout():
            consistency.check_called_everywhere(
                self.topo.comm, "opt.state_dict",
                f"every rank calls it: with zero_stage={self.stage} the state is sharded "
                f"(bm.checkpoint.save does)")
            return self.topo.comm.allgather(mine)

        layout = {}
        for theirs in runtime.get().worker.run(gather_layout, ("zero state layout",)):
            for position, entry in theirs.items():
                layout.setdefault(position, {}).update(entry)
        state = {position: {} for position in sorted(layout)}
        self._gather_tensors(layout, state)
        for position, entry in layout.items():
            for key, (kind, info) in entry.items():
                if kind == "value":
                    state[position][key] = info
        return {"state": state, "param_groups": groups}

    def _piece_states(self):
        for pc in self.pieces:
            piece_state = self.inner.state.get(pc.tensor)
            if piece_state:
                yield pc, piece_state

    def _gather_tensors(self, layout: dict, state: dict) -> None:
        """Each elementwise state entry, whole, in host memory: per bucket and entry, this
        rank's slice in place in a padded flat buffer on the bucket's device, an in-place
        allgather, then one copy to the host, so that a GPU holds one bucket's entry at a time
        beside the shards, never the whole state."""
        mine = {(id(pc.bucket), pc.position): pc for pc, _ in self._piece_states()}
        for bucket in self.buckets:
            positions = [self.position[id(p)] for p in bucket.params]
            keys = sorted({(key, info) for pos in positions
                           for key, (kind, info) in layout.get(pos, {}).items()
                           if kind == "tensor"})
            for key, dtype in keys:
                flat = torch.zeros(bucket.part * self.size,
                                   dtype=getattr(torch, dtype.replace("torch.", "")),
                                   device=bucket.device)
                for pos in positions:
                    pc = mine.get((id(bucket), pos))
                    if pc is not None and key in self.inner.state[pc.tensor]:
                        flat[pc.start:pc.stop] = self.inner.state[pc.tensor][key]
                runtime.get().worker.run(
                    lambda flat=flat, part=bucket.part: self._allgather_slices(flat, part),
                    ("zero state gather", key), bucket.device)
                whole = flat.cpu()
                for i, pos in enumerate(positions):
                    if key in {name for name, (kind, _) in layout.get(pos, {}).items()
                               if kind == "tensor"}:
                        state[pos][key] = bucket.param_view(whole, i).clone()

    def local_state_dict(self) -> dict:
        """This rank's own part, not gathered (no communication, 1/n of the state): the user's
        param groups, the inner optimizer's state over this rank's pieces, and a logical state
        loaded before the first step and not applied yet. For in-memory snapshots that this rank
        loads back (``load_local_state_dict``), as an elastic commit does; a checkpoint needs the
        logical ``state_dict``."""
        return {"param_groups": self.user.state_dict()["param_groups"],
                "inner": None if self.inner is None else self.inner.state_dict(),
                "held": self._held}

    def load_local_state_dict(self, local: dict) -> None:
        """Back to a ``local_state_dict`` of this rank, taken on the same buckets. One taken
        before the first step gives the inner optimizer empty state again (and the logical
        state then held)."""
        self.user.load_state_dict({"state": {}, "param_groups": local["param_groups"]})
        if self.inner is None:
            self._held = local["held"]
            return
        groups = self.inner.state_dict()["param_groups"]
        self.inner.load_state_dict(local["inner"] if local["inner"] is not None
                                   else {"state": {}, "param_groups": groups})
        if local["inner"] is None and local["held"] is not None:
            self._apply(local["held"])

    def load_state_dict(self, state_dict: dict) -> None:
        """Take a logical state dict (from any world size, sharded or not): the user's groups
        get the hyperparameters, the inner optimizer this rank's slices of the state."""
        self.user.load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        if self.inner is None:
            self._held = state_dict
        else:
            self._apply(state_dict)

    def _apply(self, state_dict: dict) -> None:
        full = state_dict.get("state", {})
        sliced = {}
        for index, pc in enumerate(p for g in self._inner_order() for p in g):
            entry = full.get(pc.position)
            if not entry:
                continue
            param = self.params[pc.position]
            sliced[index] = {}
            for key, value in entry.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    if value.numel() != param.numel():
                        raise ValueError(
                            f"optimizer state {key!r} of parameter {pc.position} has shape "
                            f"{tuple(value.shape)}, the parameter {tuple(param.shape)}: not an "
                            f"elementwise state, so it cannot be sharded")
                    # the slices are of the bucket's flat order: the parameter's memory
                    # order, in real elements (a complex state tensor as its real view)
                    flat = real_view(memory_order(value, param)).reshape(-1)
                    value = flat[pc.offset:pc.offset + pc.stop - pc.start].clone()
                sliced[index][key] = value
        groups = self.inner.state_dict()["param_groups"]
        self.inner.load_state_dict({"state": sliced, "param_groups": groups})

    def _inner_order(self) -> list[list[Piece]]:
        """The pieces in the inner optimizer's numbering (group by group)."""
        return [[pc for pc in self.pieces if pc.group == gi]
                for gi in range(len(self.user.param_groups))]
