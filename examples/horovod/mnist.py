"""Data-parallel MNIST the Horovod way: a DistributedSampler per rank, metrics averaged with
hvd.allreduce.

    OMP_NUM_THREADS=1 mpiexec -n 2 python examples/horovod/mnist.py --epochs 3

Rank 0 prints one line per epoch; at the end every rank prints its own test metrics next to the
averaged ones (the averaged ones are the same on every rank: that is what the allreduce is for).
"""
import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import bagua_mpi as hvd
from synthetic_mnist import Net, synthetic_mnist

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--lr", type=float, default=0.02, help="learning rate for one rank")
parser.add_argument("--train-samples", type=int, default=2048)
parser.add_argument("--test-samples", type=int, default=512)
parser.add_argument("--fp16-allreduce", action="store_true")
args = parser.parse_args()

hvd.init()
torch.manual_seed(0)
torch.set_num_threads(1)  # several ranks share the cores of one node

train_set = synthetic_mnist(args.train_samples, seed=1)
test_set = synthetic_mnist(args.test_samples, seed=2)
# Each rank reads a disjoint 1/size of the data; the sampler pads the last shard so every rank
# runs the same number of batches (a rank with one batch more would wait alone in allreduce).
train_sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank())
test_sampler = DistributedSampler(test_set, num_replicas=hvd.size(), rank=hvd.rank(),
                                  shuffle=False)
train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler)
test_loader = DataLoader(test_set, batch_size=128, sampler=test_sampler)

model = Net()
# The global batch is size times larger, so take a step size times larger.
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
# Start every rank from rank 0's weights (each rank seeded its own initialisation).
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
optimizer = hvd.DistributedOptimizer(
    optimizer, named_parameters=model.named_parameters(),
    compression=hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none)


def averaged(value: float, name: str) -> float:
    # Average over ranks: each rank only saw its own shard.
    return hvd.allreduce(torch.tensor(value, dtype=torch.float64), name=name).item()


def train_one_epoch(epoch: int) -> float:
    model.train()
    train_sampler.set_epoch(epoch)  # a different shuffle each epoch, the same on every rank
    total, batches = 0.0, 0
    for data, target in train_loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()  # gradients are averaged over ranks during backward
        optimizer.step()
        total += loss.item()
        batches += 1
    return total / batches


def evaluate() -> tuple[float, float]:
    model.eval()
    loss, correct, seen = 0.0, 0, 0
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            loss += F.cross_entropy(output, target, reduction="sum").item()
            correct += (output.argmax(1) == target).sum().item()
            seen += len(target)
    return loss / seen, correct / seen


for epoch in range(args.epochs):
    train_loss = averaged(train_one_epoch(epoch), "train_loss")
    test_loss, accuracy = evaluate()
    avg_test_loss, avg_accuracy = averaged(test_loss, "test_loss"), averaged(accuracy, "accuracy")
    if hvd.rank() == 0:
        print(f"epoch {epoch} train_loss {train_loss:.4f} test_loss {avg_test_loss:.4f} "
              f"accuracy {avg_accuracy:.4f}", flush=True)

# repr() keeps every digit, so a reader of the log can compare the ranks exactly
print(f"rank {hvd.rank()}/{hvd.size()} final: own test_loss {test_loss!r} accuracy {accuracy!r}"
      f" | averaged test_loss {avg_test_loss!r} accuracy {avg_accuracy!r}", flush=True)
