"""NCCL at world size 1 on a one-GPU machine (NCCL refuses two ranks on one GPU, so its
multi-rank path cannot run here; this checks the bootstrap over MPI, the collectives and the
optimizer's dense steps through ``ProcessGroupNCCL``, that the choice really took NCCL, that
the data-movement collectives of CUDA tensors stay on the device, and that every registered
algorithm trains on it with no payload byte through the host and no host
wait for the device in its exchanges).

Run by ``tests/gpu/run.sh`` as ``mpiexec -n 1 python tests/gpu/nccl_check.py OUT``.
"""
import collections
import json
import sys

import torch

import bagua_mpi as bm
from bagua_mpi import backends, process_groups, transport
from bagua_mpi.accounting import staging


def main():
    out = sys.argv[1]
    bm.init(backend="nccl")  # init's choice; each round below sets its own
    results = {"device": torch.cuda.get_device_name(0), "world_size": bm.size()}
    topo = bm.runtime.get().topo
    for name in ("nccl", "nccl_hierarchical"):
        backends.reset()
        backends.set_default(name)
        t = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
        want = t.clone()
        transport.nccl_allreduce_(t, topo)
        assert torch.equal(t, want), f"{name}: allreduce at world size 1 changed the data"
        assert process_groups.groups(), f"{name}: no NCCL group was made"
        # the public collectives dispatch to NCCL too (Sum, Max; Average scales on the device)
        used = []
        original_group_allreduce = process_groups.ProcessGroup.allreduce_

        def spy(self, tensor, op="sum", _orig=original_group_allreduce):
            used.append(op)
            return _orig(self, tensor, op)
        process_groups.ProcessGroup.allreduce_ = spy
        x = torch.randn(1000, device="cuda")
        assert torch.equal(bm.allreduce(x, op=bm.Sum), x)
        assert torch.equal(bm.allreduce(x, op=bm.Max), x)
        torch.testing.assert_close(bm.allreduce(x), x)
        # what NCCL cannot reduce (int16; bool's logical ops) takes MPI, alone or grouped
        i16 = torch.arange(-500, 500, dtype=torch.int16, device="cuda")
        flags = torch.arange(1000, device="cuda") % 3 == 0
        assert torch.equal(bm.allreduce(i16, op=bm.Sum), i16)
        assert torch.equal(bm.allreduce(flags, op=bm.Max), flags)
        assert torch.equal(bm.allreduce(flags, op=bm.Min), flags)
        assert torch.equal(bm.grouped_allreduce([x, i16], op=bm.Sum)[1], i16)
        process_groups.ProcessGroup.allreduce_ = original_group_allreduce
        assert used == ["sum", "max", "sum"], used
        # the optimizer's dense steps through NCCL (gradient_allreduce and a warm-up stage)
        torch.manual_seed(0)
        model = torch.nn.Linear(256, 16).cuda()
        backends.reset()  # the optimizer's own choice must be enough
        opt = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(), backend=name)
        calls = []
        original = process_groups.ProcessGroup.allreduce_

        def counting(self, tensor, op="sum", _orig=original):
            calls.append(tensor.numel())
            return _orig(self, tensor, op)
        process_groups.ProcessGroup.allreduce_ = counting
        staging.reset()
        x, y = torch.randn(64, 256, device="cuda"), torch.randn(64, 16, device="cuda")
        first = None
        for _ in range(30):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            first = first if first is not None else loss.item()
            loss.backward()
            opt.step()
        opt.close()
        process_groups.ProcessGroup.allreduce_ = original
        assert calls, f"{name}: the optimizer's dense steps did not go through NCCL"
        assert staging.snapshot()["dense_d2h_bytes"] == 0, staging.snapshot()
        assert loss.item() < first, (first, loss.item())
        results[name] = {"ok": True, "nccl_allreduces": len(calls),
                         "loss": [first, loss.item()]}
        print(f"NCCL backend {name!r} at world size 1: OK ({len(calls)} NCCL allreduces in "
              f"30 steps, loss {first:.4f} -> {loss.item():.4f})", flush=True)
    results["point_to_point"] = point_to_point_on_nccl(topo.comm)
    results["group_verbs"] = group_verbs_at_world_size_one(
        process_groups.group(topo.comm, "nccl"), "cuda")
    results["data_movement"] = data_movement_on_nccl()
    results["algorithms"] = every_algorithm_on_nccl()
    with open(out, "w") as fh:
        json.dump(results, fh, indent=1)
    bm.shutdown()


def point_to_point_on_nccl(comm) -> dict:
    """The group's batched point-to-point on real NCCL: at world size 1 a rank may send to
    itself when the receive is in the same group call, which is what ``point_to_point``
    makes of an exchange (the coalescing branch, which gloo does not take in CI). A lone
    send to oneself would wait for a receive that never comes, so only the exchange runs."""
    group = process_groups.group(comm, "nccl")
    assert group.pg.supports_coalescing, "ProcessGroupNCCL says it does not coalesce"
    send = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    recv = torch.zeros_like(send)
    group.exchange(send, [recv], [0], tag=3)
    torch.cuda.synchronize()
    assert torch.equal(recv, send), "the exchange with itself did not deliver the message"
    print("NCCL point-to-point at world size 1: OK (one batched exchange with itself)",
          flush=True)
    # the group's timeout for torch's NCCL watchdog (init passes BAGUA_MPI_STALL_ABORT_S)
    timeout = getattr(getattr(group.pg, "options", None), "_timeout", None)
    return {"ok": True, "bytes": send.numel() * 4,
            "nccl_timeout_s": None if timeout is None else timeout.total_seconds(),
            "stall_abort_s": bm.runtime.get().watchdog.abort_after}


# the dtypes the library's payloads take to a group: float32 and float64 values, 16-bit words,
# indices, quantized bytes
VERB_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
               torch.int32, torch.int8, torch.uint8)


def group_verbs_at_world_size_one(group, device) -> dict:
    """Each verb of the library's process group called on the group itself, for every dtype
    of ``VERB_DTYPES``: at world size 1 each gives its input back. The transport skips the
    reductions, the broadcast and the reduce-scatter at world size 1 (its own copy), so this
    is where they meet the library (NCCL on a GPU; CI runs it under gloo on the host)."""
    wrong, calls = [], 0
    for dtype in VERB_DTYPES:
        x = (torch.arange(4096, device=device) % 100).to(dtype)
        in_place = {f"allreduce_ {op}": lambda t, op=op: group.allreduce_(t, op)
                    for op in process_groups.REDUCE_OPS}
        in_place.update({"reduce_": lambda t: group.reduce_(t, 0),
                         "broadcast_": lambda t: group.broadcast_(t, 0)})
        into = {"allgather": group.allgather, "alltoall": group.alltoall,
                "alltoall with splits": lambda s, r: group.alltoall(s, r, [s.numel()],
                                                                    [r.numel()]),
                "reduce_scatter": group.reduce_scatter}
        got = {}
        for name, verb in in_place.items():
            got[name] = x.clone()
            verb(got[name])
        for name, verb in into.items():
            got[name] = torch.zeros_like(x)
            verb(x, got[name])
        calls += len(got)
        wrong += [f"{name} {dtype}" for name, t in got.items() if not torch.equal(t, x)]
    ok = not wrong
    print(f"{group.pg.name()} group verbs at world size 1: {'OK' if ok else 'FAIL'} ({calls} "
          f"calls over {len(VERB_DTYPES)} dtypes; wrong: {wrong})", flush=True)
    assert ok, wrong
    return {"ok": ok, "calls": calls, "wrong": wrong}


def data_movement_on_nccl() -> dict:
    """``bm.allgather``, ``broadcast``, ``alltoall`` and ``reducescatter`` of CUDA tensors on
    NCCL at world size 1 (a strided tensor, the asynchronous, grouped and gradient forms among
    them): each gives its input back, no byte goes through the host, and NCCL carried them (a
    one-rank broadcast or reduce-scatter is the transport's own copy, so the library sees the
    allgathers and alltoalls)."""
    x = torch.randn(3, 1000, device="cuda").t()  # strided
    staging.reset()
    before = collections.Counter(transport.carried)
    got = {"allgather": bm.allgather(x),
           "allgather_async": bm.synchronize(bm.allgather_async(x)),
           "broadcast": bm.broadcast(x, 0),
           "alltoall": bm.alltoall(x, [x.shape[0]])[0],
           "reducescatter": bm.reducescatter(x, op=bm.Sum),
           "grouped_allgather": bm.grouped_allgather([x, x])[1],
           "grouped_reducescatter": bm.grouped_reducescatter([x, x], op=bm.Sum)[1]}
    leaf = x.detach().clone().requires_grad_()
    bm.allgather(leaf).sum().backward()
    got["allgather_grad"] = leaf.grad - 1 + x  # the gradient of a sum is ones
    torch.cuda.synchronize()
    used = dict(transport.carried - before)
    wrong = [name for name, value in got.items() if not torch.equal(value, x)]
    snap = staging.snapshot()
    ok = not wrong and snap["d2h_bytes"] == 0 and set(used) == {"nccl"}
    print(f"NCCL data movement at world size 1: {'OK' if ok else 'FAIL'} (carried {used}, "
          f"{snap['d2h_bytes']} bytes to the host, wrong: {wrong})", flush=True)
    assert ok, (wrong, snap, used)
    return {"ok": ok, "carried": used, "d2h_bytes": snap["d2h_bytes"]}


def every_algorithm_on_nccl() -> dict:
    """Each registered algorithm, 20 steps of a CUDA model with backend="nccl": the loss falls,
    nothing is staged through the host, the exchanges make the host wait for the device zero
    times (``communication_stats()["syncs_per_bucket"]``) and the last step's allocate no
    kernel scratch (``["allocations_per_bucket"]``)."""
    found = {}
    for algo in bm.algorithms.names():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 16)).cuda()
        kwargs = {"onebit_adam": dict(warmup_steps=5), "lgreco": dict(warmup_steps=5,
                                                                     period_steps=10)}
        inner = (torch.optim.Adam(model.parameters(), lr=1e-3) if algo == "onebit_adam"
                 else torch.optim.SGD(model.parameters(), lr=0.05))
        opt = bm.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                      algorithm=bm.algorithms.create(algo, **kwargs.get(algo, {})),
                                      backend="nccl")
        x, y = torch.randn(64, 256, device="cuda"), torch.randn(64, 16, device="cuda")
        staging.reset()
        losses = []
        for _ in range(20):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            losses.append(loss.item())
            loss.backward()
            opt.step()
        stats = opt.communication_stats()
        opt.close()
        snap = staging.snapshot()
        waits = sum(stats["syncs_per_bucket"].values())
        allocations = sum(stats["allocations_per_bucket"].values())   # the last step's
        ok = (snap["d2h_bytes"] == 0 and waits == 0 and allocations == 0
              and losses[-1] < losses[0])
        found[algo] = {"ok": ok, "backend": opt.backend, "d2h_bytes": snap["d2h_bytes"],
                       "syncs_per_bucket": stats["syncs_per_bucket"],
                       "launches_per_bucket": stats["launches_per_bucket"],
                       "allocations_per_bucket": stats["allocations_per_bucket"],
                       "loss": [losses[0], losses[-1]]}
        print(f"NCCL {algo}: {'OK' if ok else 'FAIL'} {found[algo]}", flush=True)
    failed = [a for a, r in found.items() if not r["ok"]]
    assert not failed, (f"on NCCL, these staged bytes, waited, allocated scratch in their last "
                        f"step or did not learn: {failed}")
    return found


if __name__ == "__main__":
    sys.exit(main())
