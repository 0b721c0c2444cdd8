"""DistributedOptimizer: n ranks must equal single-process training on the combined batch.

``python optimizer_suite.py`` on every rank. The reference (one process, the concatenated
batch of all ranks) is computed on every rank, so each compares with it directly.
"""
import json
import os
import sys
import tempfile

import torch

import bagua_mpi as bm

STEPS = 10
BATCH = 6  # rows per rank per backward pass


class Net(torch.nn.Module):
    """Declaration order differs from execution order; one frozen weight; one branch that is
    only used on even steps."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(16, 4)
        self.frozen = torch.nn.Linear(8, 16)
        self.frozen.weight.requires_grad_(False)
        self.body = torch.nn.Linear(12, 8)
        self.embed = torch.nn.Linear(10, 12)
        self.branch = torch.nn.Linear(12, 8)

    def forward(self, x, step):
        h = torch.tanh(self.embed(x))
        b = self.body(h)
        if step % 2 == 0:
            b = b + self.branch(h)
        return self.head(torch.tanh(self.frozen(torch.tanh(b))))


def data(step: int, rank: int, rows: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(rows, 10, generator=g), torch.randn(rows, 4, generator=g)


def make_optimizer(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def reference(kind: str, size: int, passes: int) -> dict:
    torch.manual_seed(0)
    model = Net()
    opt = make_optimizer(kind, [p for p in model.parameters() if p.requires_grad])
    for step in range(STEPS):
        batches = [data(step * passes + k, r, BATCH) for k in range(passes) for r in range(size)]
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x, step), y).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def distributed(kind: str, passes: int = 1, **options):
    torch.manual_seed(0)
    model = Net()
    opt = bm.DistributedOptimizer(
        make_optimizer(kind, [p for p in model.parameters() if p.requires_grad]),
        named_parameters=model.named_parameters(), backward_passes_per_step=passes,
        find_unused_parameters=True, **options)
    bm.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(STEPS):
        opt.zero_grad()
        for k in range(passes):
            x, y = data(step * passes + k, bm.rank(), BATCH)
            loss = torch.nn.functional.mse_loss(model(x, step), y) / passes
            loss.backward()
        opt.step()
    opt.close()
    return model, opt


def assert_params_equal(model, expected: dict, what: str) -> None:
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{what}: parameter {name}: {m}")


def check_equivalence(size: int) -> int:
    configs = {
        "default": {},
        "overlap off": {"overlap": False},
        "flatten off": {"flatten": False},
        "hierarchical": {"hierarchical": True},
        "hierarchical off": {"hierarchical": False},
        "one bucket per tensor": {"bucket_size_mb": 1e-6},
        "declaration order": {"profile_order": False, "bucket_size_mb": 1e-6},
        "predivide": {"gradient_predivide_factor": 2.0},
    }
    checks = 0
    for kind in ("sgd", "adam"):
        expected = reference(kind, size, passes=1)
        for label, options in configs.items():
            model, _ = distributed(kind, **options)
            assert_params_equal(model, expected, f"{kind} {label}")
            checks += 1
        model, _ = distributed(kind, passes=4)
        assert_params_equal(model, reference(kind, size, passes=4), f"{kind} 4 passes")
        checks += 1
    return checks


def check_no_sync_and_skip_synchronize(size: int) -> int:
    """no_sync() accumulates locally; the next communicating backward sends the sum."""
    expected = reference("sgd", size, passes=2)
    torch.manual_seed(0)
    model = Net()
    opt = bm.DistributedOptimizer(make_optimizer("sgd", [p for p in model.parameters()
                                                          if p.requires_grad]),
                                  named_parameters=model.named_parameters(),
                                  find_unused_parameters=True)
    for step in range(STEPS):
        opt.zero_grad()
        with opt.no_sync():
            x, y = data(step * 2, bm.rank(), BATCH)
            (torch.nn.functional.mse_loss(model(x, step), y) / 2).backward()
        x, y = data(step * 2 + 1, bm.rank(), BATCH)
        (torch.nn.functional.mse_loss(model(x, step), y) / 2).backward()
        opt.synchronize()
        with opt.skip_synchronize():
            opt.step()
    opt.close()
    assert_params_equal(model, expected, "no_sync + skip_synchronize")
    return 1


def check_bucket_order_and_overlap(rank: int, size: int, tmp: str) -> int:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    prefix = os.path.join(tmp, "timeline")
    opt = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                  named_parameters=model.named_parameters(),
                                  bucket_size_mb=0.3, timeline=prefix)
    for step in range(8):
        opt.zero_grad()
        model(torch.randn(512, 256)).square().mean().backward()
        opt.step()
    buckets = opt.buckets
    first_names = [b.names[0] for b in buckets]
    # gradients become ready last layer first: the profiled order is the execution order reversed
    assert first_names[0].startswith("7."), first_names
    assert [int(n.split(".")[0]) for n in first_names] == sorted(
        [int(n.split(".")[0]) for n in first_names], reverse=True), first_names
    assert len(buckets) >= 4, buckets
    opt.close()
    with open(f"{prefix}.rank{rank}.json") as fh:
        events = json.load(fh)["traceEvents"]
    ends = [e["ts"] for e in events if e["name"] == "backward end"]
    comm0 = [e["ts"] for e in events if e["name"] == "comm bucket 0"]
    launch0 = [e["ts"] for e in events if e["name"] == "launch" and e["args"]["bucket"] == 0]
    assert len(ends) == 8 and len(comm0) == 8 and len(launch0) == 8, (ends, comm0, launch0)
    # skip the profiling step. Launching is deterministic: bucket 0 is handed to the comm
    # thread from the hook, before the last gradient is ready...
    assert all(l < e for l, e in zip(launch0[1:], ends[1:])), "bucket 0 launched late"
    # ...and the comm thread really starts on it while backward still runs (thread scheduling
    # on a loaded machine may delay it in some iterations, not in all seven).
    overlapped = sum(c < e for c, e in zip(comm0[1:], ends[1:]))
    assert overlapped >= 1, "bucket 0 never started communicating before backward ended"
    # ...and with overlap off it never does
    opt = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                  bucket_size_mb=0.3, overlap=False, timeline=prefix + "-noov")
    for step in range(3):
        opt.zero_grad()
        model(torch.randn(64, 256)).square().mean().backward()
        opt.step()
    opt.close()
    with open(f"{prefix}-noov.rank{rank}.json") as fh:
        events = json.load(fh)["traceEvents"]
    ends = [e["ts"] for e in events if e["name"] == "backward end"]
    comm0 = [e["ts"] for e in events if e["name"] == "comm bucket 0"]
    assert all(c >= e for c, e in zip(comm0, ends)), "communication started with overlap off"
    return 3


def check_mismatched_models(rank: int, size: int) -> int:
    if size == 1:
        return 0  # nothing to disagree with
    model = torch.nn.Linear(4, 3 if rank == size - 1 else 2)
    try:
        bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                named_parameters=model.named_parameters())
    except bm.MismatchError as exc:
        assert "weight" in str(exc) and f"rank {size - 1}" in str(exc), str(exc)
    else:
        raise AssertionError("mismatched models were accepted")
    return 1


def check_compression(size: int) -> int:
    """fp16/bf16 compression stays within half-precision error of the exact result."""
    checks = 0
    expected = reference("sgd", size, passes=1)
    for comp, tol in ((bm.Compression.fp16, 2e-3), (bm.Compression.bf16, 2e-2)):
        model, _ = distributed("sgd", compression=comp)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), expected[name], rtol=tol, atol=tol)
        checks += 1
    return checks


def main():
    bm.init()
    rank, size = bm.rank(), bm.size()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = bm.broadcast_object(tmp if rank == 0 else None)
        checks = check_equivalence(size)
        checks += check_no_sync_and_skip_synchronize(size)
        checks += check_compression(size)
        checks += check_mismatched_models(rank, size)
        checks += check_bucket_order_and_overlap(rank, size, tmp)
        bm.barrier()
    if rank == 0:
        print(f"optimizer suite OK on {size} ranks: {checks} checks", flush=True)


if __name__ == "__main__":
    sys.exit(main())
