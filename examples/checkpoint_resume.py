"""The MLP of ``train_mlp.py`` with checkpoints, pre-emption handling and resume from ``latest``.

    mpiexec -n 4 python examples/checkpoint_resume.py --checkpoint-dir ckpt --steps 200
    sbatch slurm/cpu_single_node.sbatch examples/checkpoint_resume.py --checkpoint-dir ckpt
    sbatch slurm/gpu_multi_node.sbatch examples/checkpoint_resume.py --checkpoint-dir ckpt

Run it twice: the second run resumes where the first stopped (or finds it finished). Every
``--save-every`` steps, and when Slurm's ``SIGUSR1`` arrives (``--signal=USR1@120``, or
``scancel --signal=USR1 <job>``), all ranks save together; after a signal they exit with code 75
and the sbatch template requeues the job, which resumes from ``latest``. The checkpoint holds
the model, the optimizer, the algorithm's per-rank state, the LR scheduler (in ``extras``) and
every rank's RNG states, so the resumed run computes what an uninterrupted one would have:
rank 0 prints a SHA-256 of the final parameters to compare.

Each rank trains on its GPU where torch sees one (``--device``, as in ``train_mlp.py``: visible
device local rank % count, made current), else on the CPU. The data comes from the host, as a
``DataLoader``'s would: the teacher that labels it stays on the CPU, and each batch is pinned
and copied to the GPU without blocking (what ``DataLoader(pin_memory=True)`` and
``.to(device, non_blocking=True)`` do). A resume loads into the model and optimizer already on
the device: ``bagua_mpi.checkpoint.load`` copies the saved tensors into them, so they stay on
their GPU, and restores the CUDA RNG of the current device.
"""
from __future__ import annotations

import argparse
import hashlib
import time

import torch

import bagua_mpi as bm
import bagua_mpi.checkpoint as ckpt
from bagua_mpi import preemption
from train_mlp import make_model, synthetic_batch, training_device


def parameter_digest(model: torch.nn.Module) -> str:
    """SHA-256 of the model's state, the same bytes whichever device holds it (``.cpu()``
    first: a CUDA tensor has no ``.numpy()``)."""
    h = hashlib.sha256()
    for _, t in sorted(model.state_dict().items()):
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def device_batch(step: int, rank: int, batch: int, inputs: int, teacher: torch.nn.Module,
                 device: torch.device):
    """This rank's batch of ``train_mlp``'s synthetic data, made on the host by the CPU teacher
    and moved to ``device``: from pinned memory and without blocking for a GPU, so the copy
    overlaps the host's work (the pattern of a ``DataLoader(pin_memory=True)`` batch)."""
    x, y = synthetic_batch(step, rank, batch, inputs, teacher)
    if device.type != "cuda":
        return x, y
    return (x.pin_memory().to(device, non_blocking=True),
            y.pin_memory().to(device, non_blocking=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--steps", type=int, default=200, help="total steps of the training")
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--keep", type=int, default=3, help="checkpoints to keep")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--inputs", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--algorithm", default="gradient_allreduce")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="auto: this rank's GPU where torch sees one, else the CPU")
    parser.add_argument("--step-sleep", type=float, default=0.0,
                        help="seconds to sleep per step (to watch pre-emption in a demo)")
    args = parser.parse_args()

    bm.init()
    guard = preemption.install()  # before anything slow, so SIGUSR1 never kills us
    # before the load: it restores the CUDA RNG of the current device, which must be ours
    device = training_device(args.device)
    torch.manual_seed(0)
    model = make_model(args.inputs, args.hidden, args.layers, 1).to(device)
    teacher = make_model(args.inputs, 64, 1, 1)  # the data's source: on the host, as a loader
    bm.broadcast_parameters(model.state_dict(), root_rank=0)
    bm.broadcast_parameters(teacher.state_dict(), root_rank=0)
    opt = bm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
                                  named_parameters=model.named_parameters(),
                                  algorithm=args.algorithm)
    sched = torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=40, gamma=0.7)
    torch.manual_seed(1000 + bm.rank())  # label noise differs per rank: the RNG state matters

    done = 0
    if ckpt.latest(args.checkpoint_dir) is not None:
        # into the model and optimizer already on the device: load copies the saved tensors
        # into them (the optimizer's state follows its parameters), so nothing returns to
        # the CPU and the optimizer keeps the very parameters it steps
        info = ckpt.load(args.checkpoint_dir, model=model, optimizer=opt)
        sched.load_state_dict(info.extras["scheduler"])
        done = info.step
        if bm.rank() == 0:
            print(f"resumed from {info.path} at step {done} (saved by {info.world_size} ranks)",
                  flush=True)
    elif bm.rank() == 0:
        print(f"no checkpoint in {args.checkpoint_dir}: starting at step 0", flush=True)

    def save() -> str:
        return ckpt.save(args.checkpoint_dir, model=model, optimizer=opt, step=done,
                         extras={"scheduler": sched.state_dict()}, keep=args.keep)

    last_saved = done
    while done < args.steps:
        x, y = device_batch(done, bm.rank(), args.batch, args.inputs, teacher, device)
        y = y + 0.01 * torch.randn_like(y)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        sched.step()
        done += 1
        if done % 10 == 0:
            mean_loss = bm.allreduce(loss.detach()).item()
            if bm.rank() == 0:
                print(f"step {done:5d}  loss {mean_loss:.5f}", flush=True)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if done % args.save_every == 0 and done < args.steps:
            save()
            last_saved = done
        if guard.should_stop():
            path = save() if last_saved != done else ckpt.latest(args.checkpoint_dir)
            if bm.rank() == 0:
                print(f"pre-emption: saved step {done} to {path}; exiting for requeue "
                      f"(code {preemption.REQUEUE_EXIT_CODE})", flush=True)
            opt.close()
            guard.exit()
    if last_saved != done:
        save()
    digest = parameter_digest(model)
    if bm.rank() == 0:
        print(f"finished at step {done}; parameters sha256 {digest}", flush=True)
    opt.close()
    bm.shutdown()


if __name__ == "__main__":
    main()
