"""Every example of the reference documents, in distkit's return-value form.

Runs unchanged in a single process and on any number of ranks::

    python examples/collectives_tour.py
    torchrun --nproc-per-node 4 examples/collectives_tour.py

The documents use 4 ranks for reduce_scatter and all_to_all and 3 for the object
examples; with those numbers every rank prints exactly the documents' results. With
other world sizes the same code runs, scaled to the world (one rank sends everything to
itself).

Each example is a function returning this rank's result, so the test suite checks the
documents' numbers with the same code (tests/test_reference.py).
"""

from __future__ import annotations

import torch

import distkit.dist as dist

# torch.distributed.all_to_all, uneven example: each rank's input and split sizes (4 ranks)
UNEVEN_INPUTS = [
    list(range(0, 6)),
    list(range(10, 19)),
    list(range(20, 25)),
    list(range(30, 37)),
]
UNEVEN_SPLITS = [[2, 2, 1, 1], [3, 2, 2, 2], [2, 1, 1, 1], [2, 2, 2, 1]]


def broadcast_object_list_example() -> list:
    """torch.distributed.broadcast_object_list: rank 0's list reaches every rank."""
    if dist.get_rank() == 0:
        objects = ["foo", 12, {1: 2}]  # any picklable object
    else:
        objects = [None, None, None]
    dist.broadcast_object_list(objects, src=0)
    return objects


def all_gather_object_example() -> list:
    """mmengine.dist.all_gather_object: one item of the list per rank (3 ranks)."""
    data = ["foo", 12, {1: 2}]
    return dist.all_gather_object(data[dist.get_rank() % len(data)])


def reduce_scatter_example() -> torch.Tensor:
    """torch.distributed.reduce_scatter: every rank holds [0, 1, ..., world - 1]."""
    input_list = [torch.tensor(v) for v in range(dist.get_world_size())]
    return dist.reduce_scatter(input_list, op="sum")


def all_to_all_example() -> list:
    """torch.distributed.all_to_all, even example: rank r sends element d to rank d."""
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs = list((torch.arange(world) + rank * world).chunk(world))
    return dist.all_to_all(inputs)


def _uneven_splits(length: int, world: int) -> list[int]:
    return [length // world + (1 if i < length % world else 0) for i in range(world)]


def all_to_all_uneven_example() -> list:
    """torch.distributed.all_to_all, uneven example: per-rank lengths and split sizes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    values = UNEVEN_INPUTS[rank % len(UNEVEN_INPUTS)]
    if world == len(UNEVEN_SPLITS):
        splits = UNEVEN_SPLITS[rank]
    else:
        splits = _uneven_splits(len(values), world)
    inputs = list(torch.tensor(values).split(splits))
    return dist.all_to_all(inputs)


def all_to_all_complex_example() -> list:
    """torch.distributed.all_to_all with torch.cfloat tensors."""
    rank, world = dist.get_rank(), dist.get_world_size()
    base = torch.tensor([k * (1 + 1j) for k in range(1, world + 1)], dtype=torch.cfloat)
    inputs = list((base + world * rank * (1 + 1j)).chunk(world))
    return dist.all_to_all(inputs)


EXAMPLES = {
    "broadcast_object_list": broadcast_object_list_example,
    "all_gather_object": all_gather_object_example,
    "reduce_scatter": reduce_scatter_example,
    "all_to_all": all_to_all_example,
    "all_to_all (uneven)": all_to_all_uneven_example,
    "all_to_all (complex)": all_to_all_complex_example,
}


def run_all() -> dict:
    """Run every example; return ``{name: this rank's result}``."""
    return {name: example() for name, example in EXAMPLES.items()}


def main() -> None:
    dist.init_dist("auto")
    results = run_all()
    lines = [f"{name}: {result!r}" for name, result in results.items()]
    # gather the text so the ranks print in order instead of interleaving
    everyone = dist.gather_object("\n".join(lines))
    if everyone is not None:
        for rank, text in enumerate(everyone):
            print(f"--- rank {rank} of {dist.get_world_size()} ---\n{text}")
    dist.destroy_dist()


if __name__ == "__main__":
    main()
