"""Train a classifier with DistributedDataParallel through distkit.

    python examples/train.py                                  # one process, default config
    torchrun --nproc-per-node 2 examples/train.py             # two ranks, same results
    distkit launch -n 2 examples/train.py --cfg-options train.epochs=3
    python examples/train.py configs/classification.py --work-dir out --resume

The same config with the same global batch size gives the same per-epoch loss and
accuracy on any number of ranks: the global batch is split evenly over the ranks and
DDP averages the gradients, so every step sees the same samples and the same gradient.
The main process writes a checkpoint after every epoch (``latest.pth``) and
``metrics.json`` (per-epoch train loss and validation accuracy) to the work directory,
``work_dirs/<config name>`` unless ``--work-dir`` says otherwise; ``--resume`` continues
from the last checkpoint.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
import torch.nn.functional as F
from common import (
    build_model,
    config_name,
    config_parser,
    evaluate,
    loader,
    make_dataset,
    parse_config,
)
from torch.nn.parallel import DistributedDataParallel

import distkit
import distkit.dist as dist


def save_atomically(obj: Any, path: str) -> None:
    """Write to a temporary file, then rename: a run killed mid-write leaves no torn file."""
    tmp = f"{path}.tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def metrics_table(history: list[dict]) -> Any:
    from rich.table import Table

    table = Table(title="metrics")
    for col in ("epoch", "train loss", "val accuracy"):
        table.add_column(col, justify="right")
    for row in history:
        table.add_row(str(row["epoch"]), f"{row['train_loss']:.4f}", f"{row['val_accuracy']:.4f}")
    return table


def train(cfg: Any, work_dir: str, resume: bool) -> list[dict]:
    _, world = dist.init_dist(**cfg.dist_cfg)
    batch, remainder = divmod(cfg.train.global_batch_size, world)
    if remainder:
        raise ValueError(
            f"train.global_batch_size={cfg.train.global_batch_size} does not "
            f"split evenly over {world} ranks"
        )
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    model = build_model(cfg)
    optimizer = torch.optim.SGD(
        model.parameters(),
        lr=cfg.train.lr,
        momentum=cfg.train.momentum,
        weight_decay=cfg.train.weight_decay,
    )
    history: list[dict] = []
    checkpoint = os.path.join(work_dir, "latest.pth")
    if resume and os.path.exists(checkpoint):
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        history = state["history"]
        distkit.print(f"resumed from {checkpoint} after epoch {len(history)}")
    net = DistributedDataParallel(model) if dist.is_distributed() else model

    train_set, val_set = make_dataset(cfg, "train"), make_dataset(cfg, "val")
    train_loader = loader(train_set, batch, shuffle=True, seed=cfg.seed)
    for epoch in range(len(history), cfg.train.epochs):
        train_loader.sampler.set_epoch(epoch)  # the same shuffle on every rank
        loss_sum, count = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.int64)
        steps = distkit.track(train_loader, f"epoch {epoch + 1}/{cfg.train.epochs}")
        for x, y, _ in steps:
            loss = F.cross_entropy(net(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach().double() * len(y)
            count += len(y)
            if cfg.train.step_delay:
                time.sleep(cfg.train.step_delay)
        totals = dist.all_reduce_dict({"loss_sum": loss_sum, "count": count})
        slow = cfg.train.get("slow_rank") == dist.get_rank()
        delay = cfg.train.get("slow_seconds", 0.0) if slow else 0.0
        val = evaluate(model, val_set, batch_size=256, delay=delay)
        if dist.is_main_process():
            history.append(
                {
                    "epoch": epoch + 1,
                    "train_loss": totals["loss_sum"].item() / totals["count"].item(),
                    "val_accuracy": val["accuracy"],
                    "val_samples": val["samples"],
                }
            )
            os.makedirs(work_dir, exist_ok=True)
            save_atomically(
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "history": history,
                    "config": cfg.to_dict(),
                },
                checkpoint,
            )
            write_metrics(work_dir, cfg, world, history)
            distkit.print(_row(history[-1]))
    if dist.is_main_process():
        from rich.console import Console

        Console().print(metrics_table(history))
    dist.destroy_dist()
    return history


def _row(row: dict) -> str:
    return (
        f"epoch {row['epoch']}: train loss {row['train_loss']:.4f}, "
        f"val accuracy {row['val_accuracy']:.4f} ({row['val_samples']} samples)"
    )


def write_metrics(work_dir: str, cfg: Any, world: int, history: list[dict]) -> None:
    payload = {"config": cfg.filename, "world_size": world, "epochs": history}
    tmp = os.path.join(work_dir, "metrics.json.tmp")
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2)
    os.replace(tmp, os.path.join(work_dir, "metrics.json"))


def main() -> None:
    parser = config_parser(__doc__.split("\n\n")[0], "classification.py")
    parser.add_argument(
        "--work-dir",
        default=None,
        help="where checkpoints and metrics.json go (default: work_dirs/<config>)",
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue from <work-dir>/latest.pth if it exists"
    )
    args, cfg = parse_config(parser)
    work_dir = (
        args.work_dir or cfg.get("work_dir") or os.path.join("work_dirs", config_name(args.config))
    )
    train(cfg, work_dir, args.resume)


if __name__ == "__main__":
    main()
