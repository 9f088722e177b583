"""What train.py and eval.py share: configs, the synthetic data, the model, evaluation."""

from __future__ import annotations

import argparse
import difflib
import json
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Optional

import torch
from mmengine.config import Config, DictAction
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import distkit.dist as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_config(path: str, options: Optional[Mapping[str, Any]] = None) -> Config:
    """The config at ``path`` read by mmengine (``_base_`` inheritance), with the
    ``--cfg-options`` overrides (dotted keys) merged in.

    Raises:
        KeyError: an override names a key the config does not have (mmengine would add
            it, so ``train.epoch=3`` would train for the default number of epochs).
    """
    cfg = Config.fromfile(path)
    tree = cfg.to_dict()
    for dotted in options or {}:
        check_key(tree, dotted)
    if options:
        cfg.merge_from_dict(dict(options))
    return cfg


def check_key(tree: Mapping, dotted: str) -> None:
    """Raise ``KeyError`` unless the nested dict ``tree`` has the key ``dotted``
    (``train.epochs``; a list index is a number, as in mmengine: ``a.0.b``)."""
    node: Any = tree
    parts = dotted.split(".")
    for depth, part in enumerate(parts):
        where = ".".join(parts[:depth]) or "the config"
        if isinstance(node, list):
            if not (part.isdigit() and int(part) < len(node)):
                raise KeyError(f"cannot set {dotted!r}: {where} is a list of {len(node)} items")
            node = node[int(part)]
            continue
        if not isinstance(node, Mapping):
            kind = type(node).__name__
            raise KeyError(f"cannot set {dotted!r}: {where} is {kind} {node!r:.40}, not a dict")
        if part not in node:
            close = difflib.get_close_matches(part, [str(k) for k in node], n=1)
            hint = f"; did you mean {'.'.join([*parts[:depth], close[0]])!r}?" if close else ""
            raise KeyError(f"cannot set {dotted!r}: {where} has no key {part!r}{hint}")
        node = node[part]


class CfgOptions(DictAction):
    """mmengine's ``--cfg-options`` parsing, with a usage error for an item without ``=``
    (mmengine's own action raises a bare ``ValueError`` from argparse)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: Optional[str] = None,
    ) -> None:
        for item in [values] if isinstance(values, str) else values:
            key, sep, _ = item.partition("=")
            if not sep or not key:
                parser.error(f"{option_string}: expected key=value, got {item!r}")
        super().__call__(parser, namespace, values, option_string)


def config_parser(description: str, default_config: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "config",
        nargs="?",
        default=os.path.join(ROOT, "configs", default_config),
        help=f"config file (default: configs/{default_config})",
    )
    parser.add_argument(
        "--cfg-options",
        nargs="+",
        action=CfgOptions,
        default={},
        help="override config entries: key=value, e.g. train.epochs=3 (mmengine's syntax)",
    )
    return parser


def parse_config(parser: argparse.ArgumentParser) -> tuple[argparse.Namespace, Config]:
    """The command line and the config it names; a bad override is a usage error."""
    args = parser.parse_args()
    try:
        return args, load_config(args.config, args.cfg_options)
    except KeyError as exc:
        parser.error(f"--cfg-options: {exc.args[0]}")


def config_name(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]


def make_dataset(cfg: Any, split: str) -> TensorDataset:
    """Deterministic synthetic samples: ``(features, label, dataset index)``."""
    data, part = cfg.data, cfg.data[split]
    teacher = torch.randn(
        data.num_features,
        data.num_classes,
        generator=torch.Generator().manual_seed(data.teacher_seed),
    )
    g = torch.Generator().manual_seed(part.seed)
    x = torch.randn(part.num_samples, data.num_features, generator=g)
    noise = data.noise * torch.randn(part.num_samples, data.num_classes, generator=g)
    y = (x @ teacher + noise).argmax(dim=1)
    return TensorDataset(x, y, torch.arange(part.num_samples))


def build_model(cfg: Any) -> nn.Module:
    layers: list[nn.Module] = []
    width = cfg.data.num_features
    for _ in range(cfg.model.depth):
        layers += [nn.Linear(width, cfg.model.hidden), nn.ReLU()]
        width = cfg.model.hidden
    layers.append(nn.Linear(width, cfg.data.num_classes))
    return nn.Sequential(*layers)


def loader(dataset: TensorDataset, batch_size: int, shuffle: bool, seed: int) -> DataLoader:
    """A loader over this rank's shard (DistributedSampler works with one rank too)."""
    rank, world = dist.get_dist_info()
    sampler = DistributedSampler(
        dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=False
    )
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    dataset: TensorDataset,
    batch_size: int,
    shuffle: bool = False,
    stream_to: str | None = None,
    delay: float = 0.0,
) -> dict | None:
    """Evaluate on every rank's shard; the main process gets the exact dataset's metrics.

    DistributedSampler pads the shards with repeats when the size does not divide by the
    world size; ``collect_results`` puts the results back in dataset order and drops the
    padding, so every sample counts once. With ``shuffle`` the sampler shuffles the
    shards: passing it as ``sampler=`` is what puts the results back in dataset order
    (without it they would come back shuffled). With ``stream_to``, the results stream
    to the main process through ``iter_results`` (a few MiB at a time, never all at
    once) and each prediction is written to that file as a JSON line. ``delay``: seconds
    to sleep before each batch (a straggler, for a profile to find).
    """
    model.eval()
    results = []
    batches = loader(dataset, batch_size, shuffle=shuffle, seed=0)
    for x, y, index in batches:
        if delay:
            time.sleep(delay)
        pred = model(x).argmax(dim=1)
        results += [(int(i), int(p), int(t)) for i, p, t in zip(index, pred, y)]
    model.train()
    sampler = batches.sampler if shuffle else None
    if stream_to is None:
        collected = dist.collect_results(results, len(dataset), sampler=sampler)
        if collected is None:
            return None
        return metrics(collected, len(dataset))
    with dist.iter_results(results, len(dataset), sampler=sampler) as stream:
        if not dist.is_main_process():
            for _ in stream:  # yields nothing here: it answers the main process
                pass
            return None
        with open(stream_to, "w") as f:
            return metrics(written(stream, f), len(dataset))


def written(results: Iterable[tuple[int, int, int]], f: Any) -> Iterator[tuple[int, int, int]]:
    """Pass the results through, writing each as a JSON line to ``f`` on the way."""
    for index, pred, target in results:
        f.write(json.dumps({"index": index, "prediction": pred, "target": target}) + "\n")
        yield index, pred, target


def metrics(results: Iterable[tuple[int, int, int]], size: int) -> dict:
    """Sample counts, order and accuracy of ``(index, prediction, target)`` results."""
    count = correct = 0
    seen = set()
    in_order = True
    for index, pred, target in results:
        in_order = in_order and index == count
        seen.add(index)
        correct += pred == target
        count += 1
    return {
        "samples": count,
        "unique_samples": len(seen),
        "in_order": in_order and count == size,
        "accuracy": correct / max(count, 1),
    }
