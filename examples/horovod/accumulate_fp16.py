"""Gradient accumulation and float16 gradients on the wire, the Horovod way.

    OMP_NUM_THREADS=1 mpiexec -n 2 python examples/horovod/accumulate_fp16.py

Each optimizer step runs ``--passes`` backward passes over micro-batches (a large batch that
does not fit at once); ``backward_passes_per_step`` tells the DistributedOptimizer to add them up
locally and communicate once, on the last pass. ``Compression.fp16`` halves the bytes sent.
At the end every rank prints a digest of its weights: they must be equal, since every rank
applied the same averaged gradients. ``--save`` (rank 0 writes, as usual in Horovod scripts)
keeps the weights, e.g. to compare with a run of ``--passes 1``: the same data in one pass per
step should give nearly the same model.
"""
import argparse
import hashlib

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import bagua_mpi as hvd
from synthetic_mnist import Net, synthetic_mnist

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--batch-size", type=int, default=32, help="per rank and optimizer step")
parser.add_argument("--passes", type=int, default=2, help="backward passes per step")
parser.add_argument("--lr", type=float, default=0.03, help="learning rate for one rank")
parser.add_argument("--train-samples", type=int, default=2048)
parser.add_argument("--save", default=None, help="rank 0 saves the trained weights here")
args = parser.parse_args()
assert args.batch_size % args.passes == 0, "--batch-size must split into --passes micro-batches"

hvd.init()
torch.manual_seed(hvd.rank())  # different on purpose: broadcast_parameters must fix it
torch.set_num_threads(1)

train_set = synthetic_mnist(args.train_samples, seed=3)
sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank())
loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)

model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)  # momentum buffers, hyperparameters
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=hvd.Compression.fp16,
                                     backward_passes_per_step=args.passes)

steps = passes = 0
losses = []  # per step, averaged over ranks
for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    for data, target in loader:
        optimizer.zero_grad()
        batch_loss = 0.0
        for micro_data, micro_target in zip(data.chunk(args.passes), target.chunk(args.passes)):
            # Divide by the number of passes: the summed gradient is then the mean over the
            # whole batch, as if it had been one backward pass.
            loss = F.cross_entropy(model(micro_data), micro_target) / args.passes
            loss.backward()  # communicates only on the last pass of the step
            batch_loss += loss.item()
            passes += 1
        optimizer.step()
        steps += 1
        # The loss of this rank's batch, averaged over ranks for the log.
        losses.append(hvd.allreduce(torch.tensor(batch_loss), name="batch_loss").item())
        if hvd.rank() == 0 and steps % 8 == 0:
            print(f"step {steps} loss {losses[-1]:.4f}", flush=True)

if args.save and hvd.rank() == 0:  # the weights are the same everywhere: one writer is enough
    torch.save(model.state_dict(), args.save)
weights = torch.cat([p.detach().flatten() for p in model.parameters()]).numpy()
digest = hashlib.sha256(weights.tobytes()).hexdigest()[:16]
if hvd.rank() == 0:
    print(f"mean loss of the first 4 steps {sum(losses[:4]) / 4:.4f}, "
          f"of the last 4 steps {sum(losses[-4:]) / 4:.4f}", flush=True)
print(f"rank {hvd.rank()}: {steps} steps {passes} backward passes weights {digest}", flush=True)
