"""Elastic training the Horovod way, and what happens here when a rank dies.

    OMP_NUM_THREADS=1 mpiexec -n 3 python examples/horovod/elastic_mnist.py \\
        --checkpoint-dir ckpt --die-at-step 25       # rank 1 dies: the job ends, non-zero
    OMP_NUM_THREADS=1 mpiexec -n 2 python examples/horovod/elastic_mnist.py \\
        --checkpoint-dir ckpt                        # resumes from the last commit, on 2 ranks

Horovod re-forms the ring inside the surviving processes. The ranks of an MPI job are fixed, so
bagua_mpi ends the job instead; every ``state.commit()`` is also an HDF5 checkpoint in
``--checkpoint-dir``, and the restarted job (under Slurm: ``#SBATCH --requeue``) resumes from the
last one, on the same or another number of ranks (docs/horovod.md, "When a rank dies").

``--die-at-step N`` makes rank 1 exit abruptly after step N, as a node failure would, but only on
the first attempt (``SLURM_RESTART_COUNT`` unset or 0), so a requeued job with the same command
line goes on. Lines ``commit ...`` and ``rank R start ...`` carry a digest of the weights, so
a log shows that the resumed job starts from exactly what was committed.
"""
import argparse
import hashlib
import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import bagua_mpi as hvd
from synthetic_mnist import Net, synthetic_mnist

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--lr", type=float, default=0.02, help="learning rate for one rank")
parser.add_argument("--train-samples", type=int, default=960)
parser.add_argument("--commit-every", type=int, default=4, help="steps between commits")
parser.add_argument("--checkpoint-dir", default=os.environ.get("BAGUA_MPI_ELASTIC_DIR"),
                    help="where commits are written and a restarted job resumes from")
parser.add_argument("--die-at-step", type=int, default=None,
                    help="rank 1 exits after this global step (first attempt only)")
args = parser.parse_args()

hvd.init()
torch.manual_seed(0)
torch.set_num_threads(1)

train_set = synthetic_mnist(args.train_samples, seed=4)
test_set = synthetic_mnist(384, seed=5)
# The ElasticSampler remembers how much of the epoch was processed (committed with the state),
# so a resumed job continues the epoch instead of starting it over.
train_sampler = hvd.elastic.ElasticSampler(train_set, shuffle=True, seed=1)
train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler)
test_loader = DataLoader(test_set, batch_size=128, sampler=DistributedSampler(
    test_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False))

model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())


def scale_lr():
    # The committed optimizer state carries the learning rate of the world it was saved in;
    # after a reset or a resume on another number of ranks, scale it to this world.
    for group in optimizer.param_groups:
        group["lr"] = args.lr * hvd.size()


# No broadcast_parameters here: hvd.elastic.run gives every rank rank 0's state before training
# (after loading the last commit, if the checkpoint directory holds one).
state = hvd.elastic.TorchState(model, optimizer, checkpoint_dir=args.checkpoint_dir,
                               sampler=train_sampler, epoch=0, batch=0, step=0)
state.register_reset_callbacks([scale_lr])


def weights_digest() -> str:
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    return hashlib.sha256(weights.numpy().tobytes()).hexdigest()[:16]


def commit() -> None:
    state.commit()  # collective: every rank commits at the same step
    if hvd.rank() == 0:
        print(f"commit epoch {state.epoch} batch {state.batch} step {state.step} "
              f"weights {weights_digest()}", flush=True)


def first_attempt() -> bool:
    return os.environ.get("SLURM_RESTART_COUNT", "0") == "0"


def averaged(value: float, name: str) -> float:
    return hvd.allreduce(torch.tensor(value, dtype=torch.float64), name=name).item()


def evaluate() -> float:
    model.eval()
    correct = seen = 0
    with torch.no_grad():
        for data, target in test_loader:
            correct += (model(data).argmax(1) == target).sum().item()
            seen += len(target)
    model.train()
    return averaged(correct / seen, "accuracy")


@hvd.elastic.run
def train(state):
    # Here after a fresh start, a resume from the checkpoint directory, or an in-process reset.
    print(f"rank {hvd.rank()}/{hvd.size()} start epoch {state.epoch} batch {state.batch} "
          f"step {state.step} lr {optimizer.param_groups[0]['lr']:g} "
          f"weights {weights_digest()}", flush=True)
    while state.epoch < args.epochs:
        total = batches = 0
        for data, target in train_loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
            total, batches = total + loss.item(), batches + 1
            train_sampler.record_batch(state.batch, args.batch_size)
            state.batch += 1
            state.step += 1
            if state.step % args.commit_every == 0 and batches < len(train_loader):
                commit()  # (the epoch's last batch is committed below, with the new epoch)
            if state.step == args.die_at_step and hvd.rank() == 1 and first_attempt():
                print(f"rank 1: simulated node failure after step {state.step}", flush=True)
                os._exit(1)  # no clean-up, no MPI_Finalize: as if the node went away
        train_loss = averaged(total / max(batches, 1), "train_loss")
        accuracy = evaluate()
        if hvd.rank() == 0:
            print(f"epoch {state.epoch} train_loss {train_loss:.4f} accuracy {accuracy:.4f} "
                  f"({batches} batches)", flush=True)
        # Horovod's pattern: advance the epoch and reset the sampler, then commit, so a resume
        # never repeats a finished epoch.
        state.epoch += 1
        state.batch = 0
        train_sampler.set_epoch(state.epoch)
        commit()
    return evaluate()  # (also right when a finished job is started again)


accuracy = train(state)
if hvd.rank() == 0:
    print(f"done: {state.step} steps, accuracy {accuracy:.4f}", flush=True)
