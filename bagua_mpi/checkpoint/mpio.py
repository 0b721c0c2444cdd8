"""The ``mpio`` write scheme: one file opened by all ranks through parallel HDF5 (MPI-IO), each
rank writing its own datasets at the same time.

Used when h5py is built against parallel HDF5 (``h5py.get_config().mpi``). Steps:

1. each rank turns its trees into arrays and hashes each one (SHA-256); rank 0 does the same
   for the replicated trees. The digests go into the trees' JSON placeholders;
2. the *layout* (group names, dataset names, shapes, dtypes, attrs and the JSON texts: no
   tensor data) is exchanged: replicated from rank 0 by broadcast, per-rank by allgather;
3. all ranks create every group, dataset and attribute, in the same order with the same
   arguments (parallel HDF5 requires metadata operations to be collective);
4. every rank writes the data of its own datasets with independent I/O, concurrently; closing
   the file is collective.

Datasets are contiguous and unfiltered: HDF5 writes filtered (fletcher32) datasets in parallel
only collectively, one call per dataset on every rank, which serializes the ranks and measured
15x slower than the token scheme here (``benchmarks/results/checkpoint.md``). Integrity comes
from the per-dataset SHA-256 in the placeholders (checked by ``format.read_tree``) and from the
seal over the whole file. Memory on a rank: its own arrays plus the layout of the whole file.
"""
from __future__ import annotations

import h5py
import numpy as np

from .format import LIBVER, USERBLOCK_SIZE, json_bytes, leaf_name, leaf_nodes, with_digests


class _Prepared:
    """A tree ready for parallel writing: its arrays and its layout (shared with all ranks)."""

    def __init__(self, group: str, tree):
        self.arrays = [leaf.array() for leaf in tree.leaves]
        skeleton = with_digests(tree.skeleton, self.arrays)
        self.layout = {
            "group": group, "name": tree.name, "json": json_bytes(skeleton).decode(),
            "leaves": [{"path": leaf.path, "dtype": arr.dtype.str, "shape": list(arr.shape),
                        "attr": ("torch_dtype" if "__tensor__" in node else "numpy_dtype",
                                 node["dtype"]),
                        "logical_shape": node["shape"]}
                       for leaf, arr, node in zip(tree.leaves, self.arrays,
                                                  leaf_nodes(tree.skeleton))]}


def _json_dataset(group, name: str, text: str):
    return group.create_dataset(name, shape=(len(text.encode()),), dtype=np.uint8)


def _create_tree(parent, layout: dict) -> list:
    """Collectively create one tree's objects; returns its datasets (leaves, then JSON)."""
    group = parent.create_group(layout["name"])
    made = []
    for i, leaf in enumerate(layout["leaves"]):
        dset = group.create_dataset(leaf_name(i), shape=tuple(leaf["shape"]),
                                    dtype=np.dtype(leaf["dtype"]))
        dset.attrs["path"] = leaf["path"]
        dset.attrs[leaf["attr"][0]] = leaf["attr"][1]
        dset.attrs["shape"] = np.asarray(leaf["logical_shape"], dtype=np.int64)
        made.append(dset)
    made.append(_json_dataset(group, "tree", layout["json"]))
    return made


def _write_tree(datasets: list, prepared: _Prepared, after_leaf=None) -> None:
    """Independent writes of this rank's data into datasets created collectively."""
    for dset, arr in zip(datasets, prepared.arrays):
        dset.write_direct(np.ascontiguousarray(arr))
        if after_leaf is not None:
            after_leaf()
    datasets[-1].write_direct(np.frombuffer(prepared.layout["json"].encode(), dtype=np.uint8))


def write_collective(comm, rank: int, size: int, path: str, meta: dict, shared, mine,
                     mirror_attrs, fault=None) -> None:
    """Write the checkpoint with every rank taking part (see the module docstring)."""
    meta = comm.bcast(meta if rank == 0 else None, root=0)
    meta_text = json_bytes(meta).decode()
    shared_prep = [_Prepared("", t) for t in shared] if rank == 0 else []
    shared_layout = comm.bcast([p.layout for p in shared_prep] if rank == 0 else None, root=0)
    mine_prep = [_Prepared(f"ranks/{rank}", t) for t in mine]
    rank_layouts = comm.allgather([p.layout for p in mine_prep])
    with h5py.File(path, "w", driver="mpio", comm=comm, userblock_size=USERBLOCK_SIZE,
                   libver=LIBVER, locking=False) as f:
        if fault is not None:
            fault("temp_created", rank)
        mirror_attrs(f, meta)
        meta_dset = _json_dataset(f, "meta", meta_text)
        shared_dsets = [_create_tree(f, layout) for layout in shared_layout]
        ranks = f.create_group("ranks")
        my_dsets, my_meta = None, None
        for r, layouts in enumerate(rank_layouts):
            group = ranks.create_group(str(r))
            group.attrs["rank"] = r
            text = json_bytes({"rank": r, "trees": [t["name"] for t in layouts]}).decode()
            rank_meta = _json_dataset(group, "meta", text)
            made = [_create_tree(group, layout) for layout in layouts]
            if r == rank:
                my_dsets, my_meta = made, (rank_meta, text)
        # Structure complete on every rank: now each writes its own data, concurrently.
        if rank == 0:
            meta_dset.write_direct(np.frombuffer(meta_text.encode(), dtype=np.uint8))
            for datasets, prepared in zip(shared_dsets, shared_prep):
                _write_tree(datasets, prepared)
        my_meta[0].write_direct(np.frombuffer(my_meta[1].encode(), dtype=np.uint8))
        after_leaf = (lambda: fault("rank_write", rank)) if fault is not None else None
        for datasets, prepared in zip(my_dsets, mine_prep):
            _write_tree(datasets, prepared, after_leaf)  # the fault fires at the first leaf
