"""NCCL at world size 1 on a one-GPU machine (NCCL refuses two ranks on one GPU, so its
multi-rank path cannot run here; this checks the bootstrap over MPI, the collectives and the
optimizer's dense steps through ``ProcessGroupNCCL``, and that the choice really took NCCL).

Run by ``tests/gpu/run.sh`` as ``mpiexec -n 1 python tests/gpu/nccl_check.py OUT``.
"""
import json
import sys

import torch

import bagua_mpi as bm
from bagua_mpi import backends
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
        backends.allreduce_(t, topo)
        assert torch.equal(t, want), f"{name}: allreduce at world size 1 changed the data"
        assert backends._groups, f"{name}: no NCCL group was made"
        # the public collectives dispatch to NCCL too (Sum, Max; Average scales on the device)
        used = []
        original_group_allreduce = backends.NCCLGroup.allreduce_

        def spy(self, tensor, op="sum", _orig=original_group_allreduce):
            used.append(op)
            return _orig(self, tensor, op)
        backends.NCCLGroup.allreduce_ = spy
        x = torch.randn(1000, device="cuda")
        assert torch.equal(bm.allreduce(x, op=bm.Sum), x)
        assert torch.equal(bm.allreduce(x, op=bm.Max), x)
        torch.testing.assert_close(bm.allreduce(x), x)
        backends.NCCLGroup.allreduce_ = original_group_allreduce
        assert used == ["sum", "max", "sum"], used
        # the optimizer's dense steps through NCCL (gradient_allreduce and a warm-up stage)
        torch.manual_seed(0)
        model = torch.nn.Linear(256, 16).cuda()
        backends.reset()  # the optimizer's own choice must be enough
        opt = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(), backend=name)
        calls = []
        original = backends.NCCLGroup.allreduce_

        def counting(self, tensor, op="sum", _orig=original):
            calls.append(tensor.numel())
            return _orig(self, tensor, op)
        backends.NCCLGroup.allreduce_ = counting
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
        backends.NCCLGroup.allreduce_ = original
        assert calls, f"{name}: the optimizer's dense steps did not go through NCCL"
        assert staging.snapshot()["dense_d2h_bytes"] == 0, staging.snapshot()
        assert loss.item() < first, (first, loss.item())
        results[name] = {"ok": True, "nccl_allreduces": len(calls),
                         "loss": [first, loss.item()]}
        print(f"NCCL backend {name!r} at world size 1: OK ({len(calls)} NCCL allreduces in "
              f"30 steps, loss {first:.4f} -> {loss.item():.4f})", flush=True)
    with open(out, "w") as fh:
        json.dump(results, fh, indent=1)
    bm.shutdown()


if __name__ == "__main__":
    sys.exit(main())
