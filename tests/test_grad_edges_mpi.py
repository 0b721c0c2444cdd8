"""Gradients at the edges of the exchange under a real mpiexec (see tests/mpi/grad_edges_suite.py):
1-bit Adam leaves a parameter whose ``.grad`` is None alone (at 1-3 ranks), and every gradient
algorithm takes non-contiguous (``channels_last``) gradients through the hierarchical exchange
without flattening (at 2-4 ranks, posing as nodes of two ranks). Each check is its own test;
the layout helpers the exchange relies on are tested here too, without MPI."""
import pytest
import torch

from bagua_mpi.algorithms.base import _as_flat
from bagua_mpi.layout import flat_alias, is_dense
from mpi_harness import assert_check_passed, library_algorithms, suite_job

import grad_edges_suite

CHECKS = list(grad_edges_suite.suite_checks())
ONEBIT = [c for c in CHECKS if c.startswith("onebit_")]
HIERARCHICAL = [c for c in CHECKS if c.startswith("hierarchical_")]
NODES_OF_TWO = {"BAGUA_MPI_RANKS_PER_NODE": "2"}


def only(checks):
    return [arg for check in checks for arg in ("--check", check)]


onebit_run = suite_job("grad_edges_suite.py", *only(ONEBIT), env=NODES_OF_TWO)
hierarchical_run = suite_job("grad_edges_suite.py", *only(HIERARCHICAL), env=NODES_OF_TWO,
                             timeout=600)


@pytest.mark.parametrize("nprocs", [1, 2, 3])
@pytest.mark.parametrize("check", ONEBIT)
def test_onebit_adam_leaves_parameters_without_gradient_alone(check, nprocs):
    assert_check_passed(onebit_run(nprocs), check)


@pytest.mark.parametrize("nprocs", [2, 3, 4])
@pytest.mark.parametrize("check", HIERARCHICAL)
def test_hierarchical_unflattened_channels_last(check, nprocs):
    assert_check_passed(hierarchical_run(nprocs), check)


def test_every_gradient_algorithm_has_a_hierarchical_check():
    import bagua_mpi as bm
    gradient = {n for n in library_algorithms()
                if not bm.algorithms.create(n).averages_models
                and bm.algorithms.create(n).hierarchical_refusal is None}
    assert {f"hierarchical_unflattened_channels_last_{n}" for n in gradient} <= set(HIERARCHICAL)


@pytest.mark.parametrize("make", [
    lambda: torch.randn(2, 3, 4, 5),
    lambda: torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
    lambda: torch.randn(5, 4).t(),
    lambda: torch.randn(3, 1, 4)[:, :, :].transpose(0, 2),
    lambda: torch.randn(0, 3),
    lambda: torch.randn(10)[2:7],   # dense, at a storage offset
], ids=["row_major", "channels_last", "transpose", "size_one_dim", "empty", "offset"])
def test_dense_tensors_are_seen_in_memory_order(make):
    t = make()
    assert is_dense(t)
    flat = flat_alias(t)
    assert flat.data_ptr() == t.data_ptr() or t.numel() == 0
    # the alias holds exactly t's elements, each once
    assert sorted(flat.tolist()) == sorted(t.reshape(-1).tolist())


@pytest.mark.parametrize("make", [
    lambda: torch.randn(4, 6)[:, ::2],   # gaps
    lambda: torch.randn(3, 1).expand(3, 4),   # overlaps
    lambda: torch.randn(2, 8)[:, :3],
], ids=["strided_slice", "expanded", "narrowed_rows"])
def test_tensors_with_gaps_or_overlaps_are_not_dense(make):
    assert not is_dense(make())


def test_as_flat_hands_a_channels_last_tensor_over_without_a_copy():
    t = torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last)
    seen = []

    def move(flat):
        seen.append(flat)
        assert flat.is_contiguous() and flat.dim() == 1
        flat.mul_(2)
    want = t * 2
    _as_flat(t, move)
    assert seen[0].data_ptr() == t.data_ptr()
    assert torch.equal(t, want) and t.is_contiguous(memory_format=torch.channels_last)


def test_as_flat_writes_back_through_a_copy_where_there_are_gaps():
    base = torch.randn(4, 6)
    t = base[:, ::2]
    untouched = base[:, 1::2].clone()
    want = t * 3

    def move(flat):
        assert flat.is_contiguous() and flat.dim() == 1
        flat.mul_(3)
    _as_flat(t, move)
    assert torch.equal(t, want) and torch.equal(base[:, 1::2], untouched)
