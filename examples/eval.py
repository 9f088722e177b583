"""Evaluate a checkpoint on a dataset whose size does not divide by the world size.

    python examples/eval.py                                   # work_dirs/classification/latest.pth
    torchrun --nproc-per-node 3 examples/eval.py --checkpoint out/latest.pth --out eval.json
    distkit launch -n 2 examples/eval.py --shuffle            # shuffled shards, same metric
    distkit launch -n 2 examples/eval.py --stream preds.jsonl # predictions streamed to a file

The validation set has 1001 samples, which divides by none of 2, 3 or 4 ranks.
DistributedSampler pads the last shards with repeated samples; ``dist.collect_results``
puts every rank's results back in dataset order and drops the padding, so every sample
is counted exactly once and the metric is the same on any number of ranks. The main
process reports how many samples were evaluated, how many distinct ones, and the
accuracy (and writes them as JSON with ``--out``).

``--shuffle`` evaluates shuffled shards (``DistributedSampler(shuffle=True)``) and hands
the sampler to ``collect_results(..., sampler=sampler)``, which uses its order to put
every result back at its dataset index: without ``sampler=`` the results would come
back in the shuffled order, and nothing would fail. ``--stream FILE`` collects with
``dist.iter_results`` instead: the main process receives the other ranks' predictions
a few MiB at a time, writes each as a JSON line to FILE as it arrives, and reports the
same metric without ever holding every prediction at once.
"""

from __future__ import annotations

import json
import os

import torch
from common import build_model, config_parser, evaluate, make_dataset, parse_config

import distkit
import distkit.dist as dist


def main() -> None:
    parser = config_parser(__doc__.split("\n\n")[0], "eval.py")
    parser.add_argument(
        "--checkpoint",
        default=None,
        help="checkpoint to evaluate (default: the config's eval.checkpoint, "
        "else work_dirs/classification/latest.pth)",
    )
    parser.add_argument("--out", default=None, help="also write the result as JSON here")
    parser.add_argument(
        "--shuffle", action="store_true", help="evaluate shuffled shards (same metric)"
    )
    parser.add_argument(
        "--stream",
        default=None,
        metavar="FILE",
        help="stream the predictions to the main process with iter_results and write "
        "them to FILE as JSON lines",
    )
    args, cfg = parse_config(parser)
    path = (
        args.checkpoint
        or cfg.eval.checkpoint
        or os.path.join("work_dirs", "classification", "latest.pth")
    )
    if not os.path.exists(path):
        raise SystemExit(
            f"eval.py: no checkpoint at {path}; run examples/train.py first or pass --checkpoint"
        )

    dist.init_dist(**cfg.dist_cfg)
    model = build_model(cfg)
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True)["model"])
    dataset = make_dataset(cfg, cfg.eval.split)
    result = evaluate(
        model, dataset, cfg.eval.batch_size, shuffle=args.shuffle, stream_to=args.stream
    )
    if result is not None:
        result.update(world_size=dist.get_world_size(), dataset_size=len(dataset), checkpoint=path)
        result.update(shuffled=args.shuffle, streamed_to=args.stream)
        distkit.print(
            f"evaluated {result['samples']} samples ({result['unique_samples']} "
            f"distinct, dataset size {len(dataset)}) on {result['world_size']} "
            f"rank(s): accuracy {result['accuracy']:.4f}"
        )
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)
    dist.destroy_dist()


if __name__ == "__main__":
    main()
