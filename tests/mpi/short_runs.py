"""What the suites that train every registered algorithm for a few steps share.

``HYPERPARAMETERS``: per algorithm, the hyperparameters that reach its compressed path (or its
model exchange) within five steps; algorithms not named run with their defaults.
``gan_models``: a small GAN's generator and discriminator, the same on every rank.
``PerTensorSGD``: a base for optimizers from outside torch.optim, stepping each tensor alone.
"""
import torch

HYPERPARAMETERS = {
    "onebit_adam": {"warmup_steps": 2, "chunk": 64},
    "lgreco": {"warmup_steps": 2, "period_steps": 2},
    "topk": {"density": 0.2}, "gtopk": {"density": 0.2},
    "powersgd": {"rank": 1, "min_compression": 1.0},
    "qsgd": {"chunk": 64}, "bytegrad": {"chunk": 64},
    "low_precision_decentralized": {"chunk": 64}, "local_sgd": {"period": 2},
}


def gan_models(init_seed: int = 0):
    """(generator 4 -> 6, discriminator 6 -> 1), initialised from ``init_seed``."""
    torch.manual_seed(init_seed)
    G = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 6))
    D = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return G, D


class PerTensorSGD(torch.optim.Optimizer):
    """An optimizer with a step of its own (not torch.optim's): each tensor ``p`` steps by
    ``-lr * self.direction(p, p.grad)``, which a subclass gives."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(self.direction(p, p.grad), alpha=-group["lr"])
