"""Trees: nested state (a ``state_dict``, an optimizer's state, user extras) <-> a JSON skeleton
with placeholders and one dataset per tensor (the layout is in ``format``).

Tensors keep their exact bits: dtypes NumPy has are stored natively (float16/32/64, ints,
bool, complex), bfloat16 as its uint16 words, other dtypes (float8, ...) as raw bytes; the
placeholder records the torch dtype and shape, not the strides: a tensor is stored in its
logical (row-major) order and read back row-major (the loader gives an optimizer's state its
parameters' strides: ``optimizer.match_state_layouts``). 0-d tensors are stored with shape (1,);
empty tensors have no dataset. Dicts with non-string keys, tuples, ``None``, bools, ints,
floats, strings, bytes, torch dtypes, NumPy arrays and scalars round-trip; anything else is
refused with the key path that holds it.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
import torch

from .errors import CheckpointCorruptError, CheckpointError
from .format import array_digest, json_bytes, leaf_name, leaf_nodes, read_json, write_json

# torch dtypes that NumPy represents exactly (stored natively, readable by any HDF5 tool).
_NATIVE = {torch.float16, torch.float32, torch.float64, torch.int8, torch.int16, torch.int32,
           torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128}
for _name in ("uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        _NATIVE.add(getattr(torch, _name))
_ARRAY_KINDS = "biufc"  # NumPy kinds a tree may hold (no objects, no strings)


class Leaf:
    """A tensor or array found while encoding a tree; converted only when it is written."""

    __slots__ = ("path", "value")

    def __init__(self, path: str, value):
        self.path = path
        self.value = value

    def array(self) -> np.ndarray:
        """The bytes to store: a NumPy view of the (CPU, contiguous) data, 0-d made 1-d."""
        if isinstance(self.value, np.ndarray):
            arr = np.ascontiguousarray(self.value)
        else:
            arr, _ = tensor_to_array(self.value)
        return arr.reshape(1) if arr.ndim == 0 else arr


def tensor_to_array(t: torch.Tensor) -> tuple[np.ndarray, str]:
    """The exact bits of ``t`` as a NumPy array, and how they are stored."""
    t = t.detach()
    _check_tensor(t, "tensor")
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous()
    if t.dtype in _NATIVE:
        return t.numpy(), "native"
    if t.element_size() == 2:  # bfloat16 and friends: their 16-bit words
        return t.view(torch.int16).numpy().view(np.uint16), "bits16"
    return t.reshape(-1).view(torch.uint8).numpy(), "bytes"


def array_to_tensor(arr: np.ndarray, dtype: torch.dtype, shape: list, stored: str):
    if stored == "native":
        t = torch.from_numpy(arr)
    elif stored == "bits16":
        t = torch.from_numpy(arr.view(np.int16)).view(dtype)
    elif stored == "bytes":
        t = torch.from_numpy(arr.reshape(-1)).view(dtype)
    else:
        raise ValueError(f"unknown storage {stored!r}")
    if t.dtype != dtype:
        raise ValueError(f"stored dtype {t.dtype} is not the recorded {dtype}")
    return t.reshape(shape)


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dtype


def encode_tree(obj, root: str = "") -> tuple[Any, list[Leaf]]:
    """JSON-able skeleton of ``obj`` and its tensors/arrays, in placeholder order."""
    leaves: list[Leaf] = []
    return _encode(obj, root or "<root>", leaves), leaves


def _encode(obj, path: str, leaves: list[Leaf]):
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return float(obj)
    if isinstance(obj, torch.Tensor):
        index = len(leaves) if obj.numel() else -1
        node = {"__tensor__": index, "dtype": str(obj.dtype).replace("torch.", ""),
                "shape": list(obj.shape), "stored": _storage_of(obj.dtype)}
        _check_tensor(obj, path)
        if index >= 0:
            leaves.append(Leaf(path, obj))
        return node
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in _ARRAY_KINDS:
            raise CheckpointError(f"{path}: NumPy arrays of dtype {obj.dtype} cannot be stored")
        index = len(leaves) if obj.size else -1
        if index >= 0:
            leaves.append(Leaf(path, obj))
        return {"__ndarray__": index, "dtype": obj.dtype.str, "shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        if obj.dtype.kind not in _ARRAY_KINDS:
            raise CheckpointError(f"{path}: NumPy scalars of dtype {obj.dtype} cannot be stored")
        return {"__npscalar__": obj.dtype.str, "hex": obj.tobytes().hex()}
    if isinstance(obj, torch.dtype):
        return {"__torch_dtype__": str(obj).replace("torch.", "")}
    if isinstance(obj, bytes):
        return {"__bytes__": obj.hex()}
    if isinstance(obj, tuple):  # torch.Size included
        return {"__tuple__": [_encode(v, f"{path}[{i}]", leaves) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, f"{path}[{i}]", leaves) for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _encode(v, f"{path}.{k}", leaves) for k, v in obj.items()}
        return {"__dict__": [[_encode_key(k, path), _encode(v, f"{path}[{k!r}]", leaves)]
                             for k, v in obj.items()]}
    raise CheckpointError(f"{path}: cannot store a {type(obj).__module__}.{type(obj).__name__} "
                          "(checkpoints hold tensors, arrays, numbers, strings, lists, tuples "
                          "and dicts; no pickle)")


def _check_tensor(t: torch.Tensor, path: str) -> None:
    if t.layout != torch.strided:
        raise CheckpointError(f"{path}: only dense tensors can be stored, got {t.layout}")
    if t.is_quantized:
        raise CheckpointError(f"{path}: quantized tensors cannot be stored; dequantize first")


def _encode_key(key, path: str):
    if key is None or isinstance(key, (bool, int, float, str, tuple)):
        return _encode(key, f"{path} key", [])
    raise CheckpointError(f"{path}: dict key {key!r} of type {type(key).__name__} cannot be "
                          "stored")


def _storage_of(dtype: torch.dtype) -> str:
    if dtype in _NATIVE:
        return "native"
    return "bits16" if torch.empty((), dtype=dtype).element_size() == 2 else "bytes"


def decode_tree(skeleton, read_leaf) -> Any:
    """Inverse of ``encode_tree``; ``read_leaf(index)`` returns the stored array."""
    if isinstance(skeleton, list):
        return [decode_tree(v, read_leaf) for v in skeleton]
    if not isinstance(skeleton, dict):
        return skeleton
    if "__tensor__" in skeleton:
        dtype, shape = torch_dtype(skeleton["dtype"]), skeleton["shape"]
        if skeleton["__tensor__"] < 0:
            return torch.empty(shape, dtype=dtype)
        return array_to_tensor(read_leaf(skeleton["__tensor__"]), dtype, shape,
                               skeleton["stored"])
    if "__ndarray__" in skeleton:
        dtype, shape = np.dtype(skeleton["dtype"]), skeleton["shape"]
        if skeleton["__ndarray__"] < 0:
            return np.empty(shape, dtype=dtype)
        return read_leaf(skeleton["__ndarray__"]).astype(dtype, copy=False).reshape(shape)
    if "__npscalar__" in skeleton:
        return np.frombuffer(bytes.fromhex(skeleton["hex"]), dtype=skeleton["__npscalar__"])[0]
    if "__torch_dtype__" in skeleton:
        return torch_dtype(skeleton["__torch_dtype__"])
    if "__bytes__" in skeleton:
        return bytes.fromhex(skeleton["__bytes__"])
    if "__tuple__" in skeleton:
        return tuple(decode_tree(v, read_leaf) for v in skeleton["__tuple__"])
    if "__dict__" in skeleton:
        return {_hashable(decode_tree(k, read_leaf)): decode_tree(v, read_leaf)
                for k, v in skeleton["__dict__"]}
    return {k: decode_tree(v, read_leaf) for k, v in skeleton.items()}


def _hashable(key):
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def tree_digest(skeleton, leaves: list[Leaf]) -> bytes:
    """32-byte hash of a tree's structure and exact contents (to find replicated state)."""
    h = hashlib.sha256()  # OpenSSL (SHA-NI where present): faster than blake2b here
    h.update(json_bytes(skeleton))
    for leaf in leaves:
        h.update(memoryview(leaf.array()).cast("B"))
    return h.digest()


def create_leaf_dataset(group, index: int, leaf: Leaf, node: dict):
    """Create (and fill) the dataset of one leaf, with the readable attrs."""
    arr = leaf.array()
    dset = group.create_dataset(leaf_name(index), data=arr, chunks=True, fletcher32=True)
    _label(dset, leaf, node)
    return dset


def _label(dset, leaf: Leaf, node: dict) -> None:
    dset.attrs["path"] = leaf.path
    dset.attrs["torch_dtype" if "__tensor__" in node else "numpy_dtype"] = node["dtype"]
    dset.attrs["shape"] = np.asarray(node["shape"], dtype=np.int64)


def write_tree(parent, name: str, skeleton, leaves: list[Leaf], after_first=None) -> None:
    """Write one tree as group ``parent/name``; ``after_first()`` runs after the first dataset
    (a fault-injection point for the crash tests)."""
    group = parent.create_group(name)
    for i, (leaf, node) in enumerate(zip(leaves, leaf_nodes(skeleton))):
        create_leaf_dataset(group, i, leaf, node)
        if i == 0 and after_first is not None:
            after_first()
    write_json(group, "tree", skeleton)


def read_tree(group, file_path: str):
    """Decode the tree stored in ``group``; damage raises ``CheckpointCorruptError``."""
    where = group.name
    try:
        skeleton = read_json(group, "tree")
        nodes = list(leaf_nodes(skeleton))

        def read_leaf(index: int) -> np.ndarray:
            where_leaf = f"{group.name}/{leaf_name(index)}"
            dset = group[leaf_name(index)]
            arr = dset[()]
            node = nodes[index]
            expected = int(np.prod(node["shape"], dtype=np.int64))
            if node.get("stored", "native") == "bytes":
                expected *= torch.empty((), dtype=torch_dtype(node["dtype"])).element_size()
            if arr.size != max(expected, 1):
                raise ValueError(f"{where_leaf} holds {arr.size} elements, the tree says "
                                 f"{expected}")
            if "sha256" in node and array_digest(arr) != node["sha256"]:
                raise CheckpointCorruptError(file_path, f"SHA-256 mismatch in {where_leaf}")
            return arr

        return decode_tree(skeleton, read_leaf)
    except CheckpointError:
        raise
    except (OSError, KeyError, ValueError, TypeError, json.JSONDecodeError) as exc:
        raise CheckpointCorruptError(file_path, f"cannot read {where}: {exc}") from exc
