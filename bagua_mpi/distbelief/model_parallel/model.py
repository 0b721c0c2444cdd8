"""One model replica partitioned over the ranks of a replica group (paper §3, Figure 1).

The user describes the model (a sequence of torch modules, identical and identically
initialized on every rank of the group) and the partition; each rank keeps only its part and
the framework passes the activations forward and their gradients backward across the cuts:

* ``PipelineModel(layers, group, bounds)``: by layers. Partition m runs layers
  ``[bounds[m], bounds[m+1])``; forward receives m - 1's output, computes, sends to m + 1;
  backward runs in the opposite direction (``link.pipe_send``/``pipe_recv``).
* ``BlockModel(layers, group, bounds, head)``: within layers. ``layers`` are block layers
  (``LocallyConnected2d``, ``LinearBlocks``) and parameter-free elementwise modules (ReLU, Tanh,
  ...). Partition m owns output units ``[bounds[i][m], bounds[i][m+1])`` of every block layer
  i; before layer i it receives from its neighbours only the input units its block's receptive
  fields need (``link.exchange``). The first layer reads its rows from the input, which every
  partition has. After the last block layer the blocks are gathered onto the output partition,
  which applies ``head`` (optional, any module) -- its parameters are that partition's.

Both return the model output on the output partition (``is_output``, the last one) and a 0-dim
*token* elsewhere. For training every partition calls ``loss(x, target, loss_fn).backward()``:
on the output partition that is the loss, elsewhere the token, whose backward waits for the
gradient arriving from the cut. For inference, ``forward`` under ``torch.no_grad()``.

Parameters: each partition's trainable parameters, in ``parameters()`` order, form one
contiguous range of the replica's flat parameter vector, partition after partition
(``param_range``, ``numel``). A Downpour worker or a Sandblaster worker running this partition
talks only to the shards holding that range (``step_fn``/``portion_fn`` adapt the model).
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

from ..errors import PartitionError
from .layers import is_block_layer
from .link import Link, exchange, pipe_recv, pipe_send
from .partition import check_bounds, exchange_plan

BatchFn = Callable[[int], "tuple[torch.Tensor, torch.Tensor]"]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class _Partitioned(nn.Module):
    """What both kinds of partitioned model share: the link, the flat parameter range."""

    def _setup_link(self, group: MPI.Intracomm | Link) -> None:
        if group is None or group == MPI.COMM_NULL:
            raise PartitionError("this rank has no replica group (it is not a worker): only "
                                 "workers build a partitioned model")
        self.link = group if isinstance(group, Link) else Link(group)
        self.partition = self.link.rank
        self.n_partitions = self.link.size
        self.output_partition = self.n_partitions - 1

    def _setup_params(self) -> None:
        """Collective in the group: every partition's parameter count -> contiguous ranges."""
        self.local_params = [p for p in self.parameters() if p.requires_grad]
        mine = np.array([sum(p.numel() for p in self.local_params)], dtype=np.int64)
        table = np.empty(self.n_partitions, dtype=np.int64)
        self.link.comm.Allgather(mine, table)
        counts = [int(c) for c in table]
        empty = [m for m, c in enumerate(counts) if c == 0]
        if empty:
            raise PartitionError(f"partition(s) {empty} hold no trainable parameters (counts "
                                 f"{counts}); every partition must own some, move the cuts")
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(int)
        self.param_counts = [int(c) for c in counts]
        self.param_range = (int(offsets[self.partition]), int(offsets[self.partition + 1]))
        self.numel = int(offsets[-1])

    @property
    def is_output(self) -> bool:
        return self.partition == self.output_partition

    def close(self) -> None:
        """Collective in the group: free the link's communicator."""
        self.link.close()

    # -- flat parameters ----------------------------------------------------------------------
    def flat(self, dtype=np.float32) -> np.ndarray:
        """This partition's parameters as one vector (a copy), length ``hi - lo``."""
        with torch.no_grad():
            return torch.cat([p.detach().reshape(-1).cpu() for p in self.local_params]
                             ).numpy().astype(dtype, copy=True)

    def load_flat(self, flat: np.ndarray) -> None:
        """Set this partition's parameters from its slice (length ``hi - lo``) or the whole
        replica vector (length ``numel``)."""
        flat = self._local(flat)
        src = torch.from_numpy(np.array(flat, copy=True))
        offset = 0
        with torch.no_grad():
            for p in self.local_params:
                p.copy_(src[offset:offset + p.numel()].view_as(p))
                offset += p.numel()

    def grad_flat(self, dtype=np.float32) -> np.ndarray:
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          .cpu() for p in self.local_params]).numpy().astype(dtype, copy=False)

    def _local(self, flat: np.ndarray) -> np.ndarray:
        lo, hi = self.param_range
        if np.shape(flat) == (self.numel,):
            return flat[lo:hi]
        if np.shape(flat) == (hi - lo,):
            return flat
        raise ValueError(f"partition {self.partition}: expected {hi - lo} parameters (its slice) "
                         f"or {self.numel} (the replica's vector), got shape {np.shape(flat)}")

    # -- training helpers ---------------------------------------------------------------------
    def loss(self, x, target, loss_fn: LossFn) -> torch.Tensor:
        """The loss on the output partition, the token elsewhere: call ``.backward()`` on it."""
        out = self(x)
        return loss_fn(out, target) if self.is_output else out

    def share_loss(self, loss: torch.Tensor) -> float:
        """Collective in the group: the output partition's loss value, on every partition."""
        value = np.array([float(loss.detach()) if self.is_output else 0.0])
        # nonblocking and polled: a blocking broadcast would spin on a core a neighbour needs
        self.link.wait([self.link.comm.Ibcast(value, root=self.output_partition)])
        return float(value[0])

    def step_fn(self, batch_fn: BatchFn, loss_fn: LossFn, dtype=np.float32):
        """A Downpour ``step_fn(params, step) -> (loss, gradient of this partition's slice)``.

        ``batch_fn(step) -> (x, target)`` must give the same batch on every partition of the
        replica (seed it with the replica and the step); it may differ between replicas.
        """
        def fn(params: np.ndarray, step: int):
            self.load_flat(params)
            for p in self.local_params:
                p.grad = None
            x, target = batch_fn(step)
            loss = self.loss(x, target, loss_fn)
            loss.backward()
            return self.share_loss(loss), self.grad_flat(dtype)
        return fn

    def portion_fn(self, portion_fn: Callable[[int], "tuple[torch.Tensor, torch.Tensor]"],
                   loss_fn: LossFn, dtype=np.float64):
        """A Sandblaster ``portion_fn(x, portion) -> (loss sum, gradient sum of the slice)``.

        ``portion_fn(portion) -> (inputs, targets)``; ``loss_fn`` must *sum* over the samples.
        """
        return self.step_fn(portion_fn, loss_fn, dtype)


class PipelineModel(_Partitioned):
    """A sequence of layers cut into consecutive blocks (collective constructor in the group).

    Args:
        layers: the whole model as a sequence of modules (``nn.Sequential`` or a list), the
            same on every partition; each keeps only its block.
        group: the replica's communicator (``roles.group``) or a ``Link`` on it.
        bounds: ``[0, b_1, ..., len(layers)]`` (default: layers split as evenly as possible).
    """

    def __init__(self, layers: Sequence[nn.Module], group, bounds=None):
        super().__init__()
        self._setup_link(group)
        layers = list(layers)
        self.bounds = check_bounds(bounds, len(layers), self.n_partitions, "layers")
        lo, hi = self.bounds[self.partition], self.bounds[self.partition + 1]
        self.stage = nn.Sequential(*layers[lo:hi])
        # a tensor that requires grad, so the receive of the input is in the autograd graph
        self._anchor = torch.zeros((), requires_grad=True)
        self._setup_params()

    def forward(self, x=None):
        m = self.partition
        if m > 0:  # boundary m - 1 lies between partitions m - 1 and m
            x = pipe_recv(self.link, m - 1, m - 1, self._anchor)
        y = self.stage(x)
        if m < self.n_partitions - 1:
            return pipe_send(y, self.link, m + 1, m)
        return y


class BlockModel(_Partitioned):
    """Block layers cut within themselves (see the module doc); collective constructor.

    Args:
        layers: block layers and parameter-free elementwise modules, the whole model, the
            same on every partition (each partition copies its blocks' parameters).
        group: the replica's communicator or a ``Link``.
        bounds: one bounds list per block layer (``None`` entries, or ``None``: even split).
        head: module applied on the output partition to the gathered output of the last block
            layer (e.g. ``nn.Flatten()`` then ``nn.Linear``); ``None``: the gathered output.
    """

    def __init__(self, layers: Sequence[nn.Module], group, bounds=None,
                 head: nn.Module | None = None):
        super().__init__()
        self._setup_link(group)
        layers = list(layers)
        block_idx = [i for i, layer in enumerate(layers) if is_block_layer(layer)]
        if not block_idx:
            raise PartitionError("BlockModel needs at least one block layer "
                                 "(LocallyConnected2d, LinearBlocks)")
        for i, layer in enumerate(layers):
            if i not in block_idx and any(True for _ in layer.parameters()):
                raise PartitionError(f"layer {i} ({type(layer).__name__}) has parameters but "
                                     f"is not a block layer: between block layers only "
                                     f"elementwise, parameter-free modules can be cut")
        if block_idx[0] != 0:
            raise PartitionError(f"layers before the first block layer ({block_idx[0]}) cannot "
                                 f"be cut: start with a block layer")
        if bounds is None:
            bounds = [None] * len(block_idx)
        if len(bounds) != len(block_idx):
            raise PartitionError(f"{len(block_idx)} block layers but {len(bounds)} bounds lists")
        M, m = self.n_partitions, self.partition
        self.bounds, self.plans, self.owns, self.needs = [], [], [], []
        prev = None
        steps = []
        for j, (i, b) in enumerate(zip(block_idx, bounds)):
            layer = layers[i]
            bb = check_bounds(b, layer.units, M, f"block layer {i} ({type(layer).__name__}, "
                                                 f"{layer.units} units)")
            needs = [layer.needs(bb[k], bb[k + 1]) for k in range(M)]
            if prev is None:
                owns, plan = None, None  # the input is on every partition
            else:
                if prev.unit_dim != layer.unit_dim or prev.units != layer.in_units:
                    raise PartitionError(f"block layer {i} reads {layer.in_units} units along dim"
                                         f" {layer.unit_dim}, but the previous block layer makes "
                                         f"{prev.units} along dim {prev.unit_dim}")
                owns = [(self.bounds[-1][k], self.bounds[-1][k + 1]) for k in range(M)]
                plan = exchange_plan(needs, owns)
            self.bounds.append(bb)
            self.needs.append(needs[m])
            self.owns.append(owns[m] if owns else None)
            self.plans.append(plan)
            block = layer.block(bb[m], bb[m + 1])
            end = block_idx[j + 1] if j + 1 < len(block_idx) else len(layers)
            steps.append(nn.Sequential(block, *layers[i + 1:end]))
            prev = layer
        self.dim = prev.unit_dim
        self.steps = nn.ModuleList(steps)
        units = prev.units
        root = self.output_partition
        self.gather_own = (self.bounds[-1][m], self.bounds[-1][m + 1])
        self.gather_need = (0, units) if m == root else (0, 0)
        gneeds = [(0, units) if k == root else (0, 0) for k in range(M)]
        gowns = [(self.bounds[-1][k], self.bounds[-1][k + 1]) for k in range(M)]
        self.gather_plan = exchange_plan(gneeds, gowns)
        self.head = head if m == root else None
        self.block_layers = [layers[i] for i in block_idx]  # for ``macs`` accounting
        self._setup_params()

    def forward(self, x):
        for j, step in enumerate(self.steps):
            lo, hi = self.needs[j]
            if self.plans[j] is None:
                x = x.narrow(self.block_layers[0].unit_dim, lo, hi - lo)
            else:
                x = exchange(x, self.link, self.plans[j], self.dim, self.owns[j], self.needs[j], j)
            x = step(x)
        x = exchange(x, self.link, self.gather_plan, self.dim, self.gather_own, self.gather_need,
                     len(self.steps))
        if not self.is_output:
            return x.sum()  # empty: the token whose backward sends this block's gradient home
        return self.head(x) if self.head is not None else x

    def macs(self, batch: int) -> int:
        """Multiply-adds of this partition's blocks for a batch (the head not included)."""
        m = self.partition
        return sum(layer.macs(b[m], b[m + 1], batch)
                   for layer, b in zip(self.block_layers, self.bounds) if hasattr(layer, "macs"))
