"""A Horovod PyTorch training script, unchanged except for its import line.

The structure is the usual Horovod MNIST example: ``hvd.init()``, a ``DistributedSampler`` per
rank, the learning rate scaled by ``hvd.size()``, ``broadcast_parameters`` and
``broadcast_optimizer_state`` from rank 0, ``hvd.DistributedOptimizer`` with compression, and
metrics averaged over ranks with ``hvd.allreduce`` (what Horovod's ``MetricAverageCallback``
does). The data are generated (28x28 "digits": a fixed random template per class plus noise),
so the script needs no download.

    OMP_NUM_THREADS=1 mpiexec -n 4 python examples/horovod_style_mnist.py --epochs 3
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.data.distributed

import bagua_mpi as hvd  # was: import horovod.torch as hvd


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, kernel_size=5)
        self.conv2 = nn.Conv2d(8, 16, kernel_size=5)
        self.fc1 = nn.Linear(256, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = F.relu(self.fc1(x.flatten(1)))
        return F.log_softmax(self.fc2(x), dim=1)


def synthetic_digits(n, seed):
    g = torch.Generator().manual_seed(1234)
    templates = torch.rand(10, 1, 28, 28, generator=g)
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = templates[labels] + 0.5 * torch.randn(n, 1, 28, 28, generator=g)
    return torch.utils.data.TensorDataset(images, labels)


def metric_average(val, name):
    tensor = torch.tensor(val)
    avg_tensor = hvd.allreduce(tensor, name=name)
    return avg_tensor.item()


def main():
    parser = argparse.ArgumentParser(description="Horovod-style MNIST example")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.5)
    parser.add_argument("--fp16-allreduce", action="store_true", default=False)
    parser.add_argument("--train-samples", type=int, default=1024)
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(42)
    torch.set_num_threads(1)

    train_dataset = synthetic_digits(args.train_samples, seed=1)
    test_dataset = synthetic_digits(512, seed=2)
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size,
                                               sampler=train_sampler)
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=64, sampler=test_sampler)

    model = Net()
    lr_scaler = hvd.size()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * lr_scaler,
                                momentum=args.momentum)

    # Horovod: broadcast parameters & optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression, op=hvd.Average)

    def train(epoch):
        model.train()
        train_sampler.set_epoch(epoch)
        total, batches = 0.0, 0
        for data, target in train_loader:
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
            total += loss.item()
            batches += 1
        return metric_average(total / max(batches, 1), "avg_train_loss")

    def test():
        model.eval()
        test_loss, correct, seen = 0.0, 0.0, 0
        with torch.no_grad():
            for data, target in test_loader:
                output = model(data)
                test_loss += F.nll_loss(output, target, reduction="sum").item()
                correct += output.argmax(1).eq(target).float().sum().item()
                seen += len(data)
        return (metric_average(test_loss / seen, "avg_loss"),
                metric_average(correct / seen, "avg_accuracy"))

    for epoch in range(1, args.epochs + 1):
        train_loss = train(epoch)
        test_loss, accuracy = test()
        if hvd.rank() == 0:
            print(f"epoch {epoch} train loss {train_loss:.4f} test loss {test_loss:.4f} "
                  f"accuracy {100 * accuracy:.1f}%", flush=True)

    # every rank must hold the same model
    mine = [p.detach().numpy().tobytes() for p in model.parameters()]
    assert hvd.allgather_object(mine) == [mine] * hvd.size(), "ranks ended with different models"
    if hvd.rank() == 0:
        print(f"horovod-style training OK on {hvd.size()} ranks", flush=True)


if __name__ == "__main__":
    main()
