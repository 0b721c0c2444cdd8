"""MNIST-shaped data made up on the spot, and the small CNN the scripts here train.

It stands in for ``torchvision.datasets.MNIST`` so that the examples need no download (CI has no
network): 28x28 single-channel images in 10 classes, each class a fixed random stroke pattern
plus noise. The patterns depend only on a fixed seed, so every rank and every run (a requeued
job included) sees the same classes; ``seed`` picks which samples are drawn.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


def synthetic_mnist(n: int, seed: int, noise: float = 0.4) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(2024)  # the same ten "digits" everywhere
    templates = (torch.rand(10, 1, 28, 28, generator=g) > 0.75).float()  # a quarter of pixels on
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = templates[labels] + noise * torch.randn(n, 1, 28, 28, generator=g)
    # zero mean, unit variance, as transforms.Normalize does for the real MNIST (without it
    # SGD sits on a plateau for the first epochs)
    images = (images - 0.25) / (0.25 * 0.75 + noise ** 2) ** 0.5
    return torch.utils.data.TensorDataset(images, labels)


class Net(nn.Module):
    """LeNet-sized: two conv layers and two linear ones (about 12k parameters)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, kernel_size=5)
        self.conv2 = nn.Conv2d(6, 12, kernel_size=5)
        self.fc1 = nn.Linear(12 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        return self.fc2(F.relu(self.fc1(x.flatten(1))))
