"""torch.compile: the listed collectives trace with fullgraph=True; the rest break cleanly.

Compiling is slow on a small machine: each check compiles few functions (backend
``aot_eager``), and compares each with the same function run eagerly, on every rank.
"""

from __future__ import annotations

import pytest
import torch
from conftest import in_fresh_world, modern_compile, world
from helpers_subprocess import run

import distkit.dist as dist
from distkit.testing import ranks

pytestmark = [modern_compile, pytest.mark.usefixtures("fresh_pools_after")]

COMPILE_TIMEOUT = 600


def _compiled(fn, fullgraph: bool = True, backend: str = "aot_eager"):
    import torch._dynamo

    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, fullgraph=fullgraph)


def _same(got, expected) -> None:
    if isinstance(expected, (list, tuple)):
        assert type(got) is type(expected) and len(got) == len(expected)
        for g, e in zip(got, expected):
            _same(g, e)
    elif isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor)
        assert got.dtype == expected.dtype and torch.equal(got, expected), (got, expected)
    else:
        assert got == expected


def _against_eager(fn, *inputs, fullgraph: bool = True, backend: str = "aot_eager"):
    """Run ``fn`` compiled and eagerly on copies of ``inputs``: same results, same writes."""
    eager_in = [t.clone() for t in inputs]
    compiled_in = [t.clone() for t in inputs]
    expected = fn(*eager_in)
    got = _compiled(fn, fullgraph, backend)(*compiled_in)
    _same(got, expected)
    _same(compiled_in, eager_in)  # in-place collectives filled the caller's tensors
    return got


def _reductions(f, i):
    out = [dist.all_reduce(f.clone(), op=op) for op in ("sum", "mean", "max", "min", "product")]
    out += [dist.all_reduce(i.clone(), op=op) for op in ("mean", "band", "bor", "bxor")]
    dist.all_reduce(f)  # in place, on the caller's tensor
    return out


def _gather_scatter(t, flat):
    gathered = dist.all_gather(t, same_shape=True)
    rank, size = dist.get_rank(), dist.get_world_size()
    return (
        torch.stack(gathered),
        dist.reduce_scatter(flat, op="sum"),
        dist.reduce_scatter(list(flat.chunk(size)), op="max"),
        dist.all_to_all_single(flat),
        dist.all_to_all_single(flat, [2] * size, [2] * size),
        dist.broadcast(t, src=size - 1),
        torch.tensor([rank, size, int(dist.is_distributed())]),
    )


@ranks(0, 2, timeout=COMPILE_TIMEOUT)
def test_listed_collectives_trace_with_fullgraph_and_match_eager():
    import torch._dynamo

    rank, size = world()
    f = torch.tensor([rank + 1.0, -2.0 * rank, 0.5])
    i = torch.tensor([rank + 5, 3, -7 * (rank + 1)])
    _against_eager(_reductions, f, i)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(_reductions)(f.clone(), i.clone())
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    t = torch.arange(3.0) + 10 * rank
    flat = torch.arange(2.0 * size * 2).view(2 * size, 2) * (rank + 1)
    _against_eager(_gather_scatter, t, flat)


def _uneven_splits(t):
    rank, size = dist.get_rank(), dist.get_world_size()
    out_splits = [rank + 1] * size  # rank s sends r + 1 rows to rank r
    in_splits = [r + 1 for r in range(size)]
    return dist.all_to_all_single(t, out_splits, in_splits)


def _on_groups(t, group):
    out = dist.all_reduce(t.clone(), op="mean", group=group)
    got = dist.all_gather(t, group=group, same_shape=True)
    return out * dist.get_world_size(group) + dist.get_rank(group), torch.stack(got)


def test_uneven_explicit_splits_and_group_forms_trace():
    # a world of its own: the mesh's groups must not reach the shared pools (conftest)
    in_fresh_world(_splits_and_group_forms, 2, timeout=COMPILE_TIMEOUT)


def _splits_and_group_forms():
    from torch.distributed.device_mesh import init_device_mesh

    from distkit.utils import get_group

    rank, size = world()
    t = torch.arange(sum(r + 1 for r in range(size)), dtype=torch.float32) + 100 * rank
    _against_eager(_uneven_splits, t)
    get_group(list(range(size)))  # a cached rank list
    mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("dp",))
    for group in (list(range(size)), mesh, (mesh, "dp"), (mesh, 0)):
        _against_eager(lambda x, g=group: _on_groups(x, g), torch.tensor([rank + 1.0, 2.0]))


def _breaks(t):
    t = t * 2  # something to compile before the break
    parts = dist.all_gather(t[: dist.get_rank() + 1])  # uneven: shapes are exchanged
    objs = dist.all_gather_object({"r": dist.get_rank()})
    dist.barrier()
    handle = dist.all_reduce(t.clone(), async_op=True)
    return torch.cat(parts), torch.tensor([o["r"] for o in objs]), handle.wait() + 1


@ranks(2, timeout=COMPILE_TIMEOUT)
def test_what_cannot_trace_breaks_the_graph_cleanly_and_stays_correct():
    import torch._dynamo

    rank, _ = world()
    t = torch.arange(4.0) + rank
    torch._dynamo.reset()
    explained = torch._dynamo.explain(_breaks)(t.clone())
    reasons = " ".join(str(r.reason) for r in explained.break_reasons)
    assert explained.graph_break_count >= 1
    assert "distkit.dist.all_gather cannot be traced" in reasons
    _against_eager(_breaks, t, fullgraph=False)
    with pytest.raises(Exception, match=r"distkit\.dist\.all_gather_object pickles objects"):
        _compiled(lambda x: x + len(dist.all_gather_object({"r": 1})))(t)
    torch._dynamo.reset()


def _bad_op(t):
    return dist.all_reduce(t, op="nope")


@ranks(0, 2, timeout=COMPILE_TIMEOUT)
def test_argument_errors_are_the_eager_ones():
    t = torch.ones(2)
    with pytest.raises(ValueError) as eager:
        _bad_op(t)
    with pytest.raises(ValueError) as compiled:  # the same error, the same message
        _compiled(_bad_op, fullgraph=False)(t)
    assert str(compiled.value) == str(eager.value)
    with pytest.raises(Exception) as strict:  # fullgraph: torch wraps it, message kept
        _compiled(_bad_op)(t)
    assert str(eager.value) in str(strict.value)
    torch._dynamo.reset()


def _grad_step(x):
    gathered = dist.all_gather(x * 2, grad=True, same_shape=True)
    reduced = dist.all_reduce(x.sin(), op="mean", grad=True)
    scattered = dist.reduce_scatter(x.repeat(dist.get_world_size(), 1), grad=True)
    loss = sum((i + 1) * g.pow(2).sum() for i, g in enumerate(gathered))
    return loss + reduced.sum() * 3 + scattered.exp().sum()


@ranks(0, 2, timeout=COMPILE_TIMEOUT)
def test_grad_collectives_trace_forward_and_backward():
    rank, _ = world()
    base = torch.arange(6.0).view(2, 3) / 10 + rank
    x_eager = base.clone().requires_grad_()
    _grad_step(x_eager).backward()
    x = base.clone().requires_grad_()
    loss = _compiled(_grad_step)(x)
    loss.backward()
    torch.testing.assert_close(x.grad, x_eager.grad)
    torch._dynamo.reset()


def _inductor_step(x):
    loss = (x * x).sum()
    mean = dist.all_reduce(loss.detach().clone(), op="mean")
    gathered = dist.all_gather(x + 1, same_shape=True)
    dist.all_reduce(x)  # in place, on the caller's tensor
    return mean, torch.stack(gathered), x


@pytest.mark.slow
@ranks(2, timeout=COMPILE_TIMEOUT)
def test_a_step_compiles_with_inductor_and_matches_eager():
    """The same traced collectives through inductor (needs a C compiler, as inductor does)."""
    import shutil

    import torch._dynamo

    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("inductor needs a C compiler and this machine has none")
    rank, _ = world()
    base = torch.arange(4.0) + rank
    expected = _inductor_step(base.clone())
    torch._dynamo.reset()
    got = torch.compile(_inductor_step, backend="inductor", fullgraph=True)(base.clone())
    _same(list(got), list(expected))
    torch._dynamo.reset()


# -- sub-groups and mesh dimensions: src, dst and list indices are group ranks ------------


def _t(g: int) -> torch.Tensor:
    """What the rank of global rank ``g`` passes."""
    return torch.tensor([10.0 * g + 1, -g - 0.5])


def _flat(g: int, n: int) -> torch.Tensor:
    return torch.arange(4.0 * n).view(2 * n, 2) + 100 * g


def _on_a_sub_group(t, flat, group):
    """Every traced collective on ``group``; src and list indices are group ranks."""
    size = dist.get_world_size(group)
    return (
        dist.broadcast(t.clone(), src=0, group=group),
        dist.broadcast(t.clone(), src=size - 1, group=group),
        dist.all_reduce(t.clone(), op="max", group=group),
        dist.all_gather(t, group=group, same_shape=True),
        dist.reduce_scatter(flat, group=group),
        dist.reduce_scatter(list(flat.chunk(size)), op="min", group=group),
        dist.all_to_all_single(flat, group=group),
        dist.all_to_all_single(flat, [2] * size, [2] * size, group=group),
        torch.tensor([dist.get_rank(group), size]),
    )


def _expected_on(members: list[int], g: int) -> tuple:
    """What :func:`_on_a_sub_group` returns on global rank ``g`` of ``members``."""
    n, q = len(members), members.index(g)
    flats = [_flat(m, n) for m in members]
    return (
        _t(members[0]),
        _t(members[-1]),
        torch.stack([_t(m) for m in members]).amax(0),
        [_t(m) for m in members],
        sum(flats)[2 * q : 2 * q + 2],
        torch.stack([f.chunk(n)[q] for f in flats]).amin(0),
        torch.cat([f[2 * q : 2 * q + 2] for f in flats]),
        torch.cat([f[2 * q : 2 * q + 2] for f in flats]),
        torch.tensor([q, n]),
    )


def _eagerly_on_a_sub_group(t, group):
    """What runs eagerly under compile and takes a src or dst (a graph break each)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    last = size - 1
    parts = [t + 1000 * r for r in range(size)] if rank == last else None
    return (
        dist.reduce(t.clone(), dst=last, group=group),
        dist.gather(t, dst=last, group=group, same_shape=True),
        dist.scatter(parts, src=last, group=group),
        dist.broadcast(t.clone(), src=last, group=group, async_op=True).wait(),
    )


def _check_group(group, members: list[int], eager_too: bool = True) -> None:
    """Compiled equals eager equals the expected values, on this member of ``group``
    (``eager_too``: the calls that run eagerly under compile as well).

    Backend ``eager``: what a group changes is the graph dynamo captures (the group's
    name, group ranks for src and dst), not what AOT autograd then does with it (the
    default group's graphs go through AOT and inductor above)."""
    g = dist.get_rank()
    n = len(members)
    got = _against_eager(
        lambda t, f: _on_a_sub_group(t, f, group), _t(g), _flat(g, n), backend="eager"
    )
    _same(list(got), list(_expected_on(members, g)))
    if not eager_too:
        return
    got = _against_eager(
        lambda t: _eagerly_on_a_sub_group(t, group), _t(g), fullgraph=False, backend="eager"
    )
    last = members[-1]
    assert torch.equal(got[0], sum(_t(m) for m in members) if g == last else _t(g))
    if g == last:
        _same(got[1], [_t(m) for m in members])
    assert torch.equal(got[2], _t(last) + 1000 * members.index(g))
    assert torch.equal(got[3], _t(last))


def _sub_groups():
    import torch.distributed as td

    from distkit.utils import get_group

    rank, size = world()
    assert size >= 3  # rank 3, if any, only takes part in making the groups
    get_group([1, 2])  # created on every rank before compiling
    get_group([2, 0])  # its group ranks follow the global order: 0, then 2
    made = td.new_group([1, 2])
    try:
        if rank in (1, 2):
            _check_group([1, 2], [1, 2])
            _check_group(made, [1, 2])
        if rank in (0, 2):
            _check_group([2, 0], [0, 2])
    finally:
        td.destroy_process_group(made)
    torch._dynamo.reset()


def _mesh_dimensions():
    from torch.distributed.device_mesh import init_device_mesh

    rank, _ = world()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = [rank % 2, 2 + rank % 2]  # row-major: rank = 2 * dp + tp
    tp = [rank - rank % 2, rank - rank % 2 + 1]
    # the index form names the dp dimension again: its traced calls are what differs (the
    # eager ones resolve it as every other call does, which tests/test_mesh.py checks)
    for group, members, eager_too in (
        (mesh["dp"], dp, True),
        ((mesh, "tp"), tp, True),
        ((mesh, 0), dp, False),
    ):
        _check_group(group, members, eager_too)
    _mesh_as_an_argument(mesh, dp)
    torch._dynamo.reset()


def _mesh_step(t, mesh, pair):
    dp, tp = mesh["dp"], (mesh, "tp")
    summed = dist.all_reduce(t.clone(), group=dp)
    gathered = dist.all_gather(t, group=tp, same_shape=True)
    paired = dist.all_reduce(t.clone(), op="max", group=pair)
    info = torch.tensor([dist.get_rank(group=dp), dist.get_world_size(group=tp)])
    return summed, torch.stack(gathered), paired, info


def _mesh_as_an_argument(mesh, pair: list[int]) -> None:
    """The mesh an input of the compiled step (not a constant of it), beside a rank list
    that get_group created eagerly on every rank, through AOT autograd."""
    from distkit.utils import get_group

    pairs = [get_group([0, 2]), get_group([1, 3])]  # created eagerly, on every rank
    assert pairs[dist.get_rank() % 2] is not None
    t = torch.tensor([dist.get_rank() + 1.0, -dist.get_rank()])
    expected = _mesh_step(t.clone(), mesh, pair)
    got = _compiled(_mesh_step)(t.clone(), mesh, pair)
    _same(list(got), list(expected))


def _sub_groups_and_mesh_dimensions():
    _sub_groups()
    _mesh_dimensions()


def test_sub_groups_and_mesh_dimensions_trace_with_group_ranks():
    # group [1, 2] numbers global rank 2 as 1, which a global src would miss; a world of
    # its own (one for the sub-groups and the mesh: a fresh world of four ranks costs
    # seconds of CPU), as the groups and the mesh's must not reach the shared pools
    in_fresh_world(_sub_groups_and_mesh_dimensions, 4, timeout=COMPILE_TIMEOUT)


# -- every dtype eager moves: compiled results equal eager ones, bit for bit --------------

_FLOAT8 = [
    getattr(torch, name)
    for name in (
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    )
    if hasattr(torch, name)
]
_FLOAT4 = [getattr(torch, n) for n in ("float4_e2m1fn_x2",) if hasattr(torch, n)]
#: every dtype the eager collectives accept on gloo (gloo itself refuses int16, the wide
#: unsigned types, float8 and float4, which distkit carries: see distkit.dist.backends.gloo)
EVERY_DTYPE = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.uint16,
    torch.int32,
    torch.uint32,
    torch.int64,
    torch.uint64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex32,
    torch.complex64,
    torch.complex128,
    *_FLOAT8,
    *_FLOAT4,
]


def _ops_of(dtype: torch.dtype) -> tuple[str, ...]:
    """The ops :func:`distkit.dist.all_reduce` accepts for ``dtype`` (float4: none)."""
    if dtype in _FLOAT4:
        return ()
    if dtype is torch.complex32:  # torch cannot divide it on the CPU: eager's mean fails too
        return ("sum",)
    if dtype.is_complex:
        return ("sum", "mean")
    ops = ("sum", "mean", "max", "min", "product")
    return ops if dtype.is_floating_point else (*ops, "band", "bor", "bxor")


def _of(dtype: torch.dtype, rank: int, n: int) -> torch.Tensor:
    """``n`` values of ``dtype`` that depend on ``rank`` (signed types get negatives)."""
    i = torch.arange(n) + 3 * rank
    if dtype is torch.bool:
        return i % 3 != 0
    if dtype in _FLOAT4:  # no arithmetic: from its bytes
        return (i % 251).to(torch.uint8).view(dtype)
    if dtype == getattr(torch, "float8_e8m0fnu", None):  # powers of two only
        return (2.0 ** (i % 5)).to(dtype)
    values = (i % 7 + 1).to(torch.float32)
    if dtype.is_signed:
        values = values * (1 - 2 * (i % 2))
    return values.to(dtype)


def _every_traced_call(t, flat, ops):
    size = dist.get_world_size()
    out = []
    for op in ops:
        out.append(dist.all_reduce(t.clone(), op=op))
        if t.dtype is not torch.complex32:  # torch has no CPU sum of it: eager fails too
            out.append(dist.reduce_scatter(flat, op=op))
    if ops and t.dtype is not torch.complex32:
        # the input as a list of chunks: each is reduced by the flat form's code, so one op
        out.append(dist.reduce_scatter(list(flat.chunk(size)), op=ops[-1]))
    out.append(dist.all_gather(t, same_shape=True))
    out.append(dist.all_to_all_single(flat))
    out.append(dist.all_to_all_single(flat, [2] * size, [2] * size))
    out.append(dist.broadcast(t.clone(), src=size - 1))
    out.append(dist.broadcast(t.clone(), src=0))
    if ops:
        dist.all_reduce(t, op=ops[0])  # in place, on the caller's tensor
    return out


def _same_bits(got, expected) -> None:
    if isinstance(expected, (list, tuple)):
        assert type(got) is type(expected) and len(got) == len(expected)
        for g, e in zip(got, expected):
            _same_bits(g, e)
        return
    assert got.dtype == expected.dtype and got.shape == expected.shape, (got, expected)
    if got.dtype is torch.bool:  # by value: gloo's sum of bools leaves bytes of 2 eagerly
        got, expected = got.to(torch.uint8), expected.to(torch.uint8)
    g, e = got.contiguous().view(torch.uint8), expected.contiguous().view(torch.uint8)
    assert torch.equal(g, e), (got.view(torch.uint8), expected.view(torch.uint8))


def _every_dtype(cases):
    """:func:`_every_traced_call` for each ``(t, flat, ops)`` of ``cases``: one graph for
    every dtype (a compile per dtype cost the suite a minute on two cores)."""
    return [_every_traced_call(t, flat, ops) for t, flat, ops in cases]


@ranks(0, 1, 2, 3, timeout=COMPILE_TIMEOUT)
@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_every_dtype_compiles_to_the_eager_result():
    rank, size = world()
    cases = [
        (_of(dtype, rank, 4), _of(dtype, 100 + rank, 4 * size).view(2 * size, 2), _ops_of(dtype))
        for dtype in EVERY_DTYPE
    ]
    eager_in = [(t.clone(), flat.clone(), ops) for t, flat, ops in cases]
    expected = _every_dtype(eager_in)
    compiled_in = [(t.clone(), flat.clone(), ops) for t, flat, ops in cases]
    # The graph dynamo captures is what differs by dtype and by world; AOT autograd's
    # functionalization of it does not depend on the world's size. So the graph of every
    # dtype goes through AOT (backend aot_eager) in the worlds of one rank, and runs as
    # captured (backend eager, a quarter less CPU per rank) in the larger ones, whose
    # values are what they add (a step through inductor runs on 2 ranks above).
    backend = "aot_eager" if size == 1 else "eager"
    got = _compiled(_every_dtype, backend=backend)(compiled_in)
    assert len(got) == len(expected) == len(EVERY_DTYPE)
    for dtype, g, e, ci, ei in zip(EVERY_DTYPE, got, expected, compiled_in, eager_in):
        try:
            _same_bits(g, e)
            _same_bits(list(ci[:2]), list(ei[:2]))  # the in-place all_reduce
        except AssertionError as exc:
            raise AssertionError(f"{dtype}: {exc}") from None
    for dtype, (t, flat, _) in zip(EVERY_DTYPE, cases):
        if dtype in _FLOAT4 and dist.is_distributed():  # no arithmetic: the eager TypeError
            for reduce, x in ((dist.all_reduce, t), (dist.reduce_scatter, flat)):
                with pytest.raises(TypeError, match="cannot be reduced") as eager:
                    reduce(x.clone())
                with pytest.raises(Exception) as strict:  # fullgraph: torch wraps it
                    _compiled(reduce)(x.clone())
                assert str(eager.value) in str(strict.value)
    torch._dynamo.reset()


def _pipeline_stage(x):
    """A stage of a pipeline: compute, hand the activations on, take the ones that come."""
    rank, size = dist.get_rank(), dist.get_world_size()
    y = x * 2 + 1
    got = dist.exchange({(rank + 1) % size: y[: rank + 1]}, [(rank - 1) % size])
    return got[(rank - 1) % size].sum() + y


@ranks(0, 2, timeout=COMPILE_TIMEOUT)
def test_point_to_point_breaks_the_graph_with_a_reason_and_stays_correct():
    import torch._dynamo

    rank, size = world()
    t = torch.arange(4.0) + rank
    _against_eager(_pipeline_stage, t, fullgraph=False)
    if size > 1:
        torch._dynamo.reset()
        explained = torch._dynamo.explain(_pipeline_stage)(t.clone())
        reasons = " ".join(str(r.reason) for r in explained.break_reasons)
        assert "distkit.dist.exchange moves data point to point" in reasons, reasons
        with pytest.raises(Exception, match=r"distkit\.dist\.send moves data point to point"):
            _compiled(lambda x: dist.send(x, 1 - rank) or x)(t)

        # the plain blocking calls (their lanes), in a step compiled again for each new k:
        # the hook left on for the code that runs eagerly compiled distkit's own functions
        # one by one, and failed hard on the receive's process group
        def step(x, k):
            if rank == 0:
                dist.send(x * 2, 1)
                return x
            return dist.recv(0) + k

        compiled = _compiled(step, fullgraph=False, backend="eager")
        for k in range(6):
            x = torch.full((64, 64) if k != 4 else (32, 128), float(k))
            out = compiled(x, k)
            assert torch.equal(out, x if rank == 0 else x * 2 + k), k
    torch._dynamo.reset()


def _helpers(t):
    """The helpers made of several collectives, or that draw at run time, each after some
    tensor code (so that ``explain`` records each break)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    t = t * 2
    reduced = dist.all_reduce_dict({"a": t.clone(), "b": t + rank})
    t = t + 1
    param = t.clone()
    dist.all_reduce_params([param, t[:2].clone()])
    t = t + 1
    seed = dist.sync_random_seed()
    t = t + 1
    collected = dist.collect_results([rank * 10 + 1, rank * 10 + 2], 2 * size)
    t = t + 1
    with dist.iter_results([rank, -rank], 2 * size) as stream:
        streamed = list(stream)
    t = t + 1
    info = torch.tensor(collected or [-1]).sum() + torch.tensor(streamed or [-1]).sum()
    return t + reduced["a"] + reduced["b"] + param + info, seed


#: The helpers, each named in its own graph break's reason.
_HELPERS = ("all_reduce_dict", "all_reduce_params", "sync_random_seed", "collect_results")


@ranks(0, 2, timeout=COMPILE_TIMEOUT)
def test_helpers_run_eagerly_between_graphs_with_a_reason():
    """With a process group or without, the tracer does not step into a helper's code (it
    printed dynamo's warnings, and a ResultStream's finalizer failed): each runs eagerly, a
    graph break whose reason names it, with the eager result."""
    import warnings

    import torch._dynamo

    rank, size = world()
    t = torch.arange(4.0) + rank
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        explained = torch._dynamo.explain(_helpers)(t.clone())
        (got, seed), (expected, eager_seed) = _compiled(_helpers, False)(t.clone()), _helpers(t)
    reasons = " ".join(str(r.reason) for r in explained.break_reasons)
    for name in _HELPERS:
        assert f"distkit.dist.{name} " in reasons, (name, reasons)
    assert "distkit.dist.iter_results pickles objects" in reasons, reasons
    assert not [str(w.message) for w in caught if "dynamo" in str(w.filename)]
    _same(got, expected)
    # each call draws a seed (a graph would have frozen one), the same on every rank
    assert seed != eager_seed
    assert dist.all_gather_object((seed, eager_seed)) == [(seed, eager_seed)] * size
    with pytest.raises(Exception, match=r"distkit\.dist\.sync_random_seed draws a new seed"):
        _compiled(lambda x: x + dist.sync_random_seed())(t)
    torch._dynamo.reset()


@ranks(0, timeout=COMPILE_TIMEOUT)
def test_object_collectives_with_no_group_trace_with_fullgraph():
    """With no process group an object collective returns what a world of one returns,
    traced: the check that a flat dict may skip pickling read a Python constant's type."""
    for data in (1, "s", 0.5, {"loss": 0.5, "n": 3}, [1, 2]):

        def gather(x, data=data):
            return x + 1, dist.all_gather_object(data), dist.broadcast_object(data)

        out, gathered, broadcast = _compiled(gather)(torch.zeros(2))
        assert gathered == [data] and broadcast == data, (data, gathered, broadcast)
        assert torch.equal(out, torch.ones(2))
    torch._dynamo.reset()


COLD = """
import torch
import distkit.dist as dist
from distkit import _registry

def step(t, flat):  # the process's first collectives: met first while tracing
    return [dist.reduce_scatter(flat, op="sum"), dist.all_reduce(t * 2), dist.broadcast(t)]

t, flat = torch.arange(4.0), torch.arange(8.0).view(4, 2)
got = torch.compile(step, backend="eager", fullgraph=True)(t.clone(), flat.clone())
expected = step(t.clone(), flat.clone())
assert len(got) == 3 and all(torch.equal(g, e) for g, e in zip(got, expected)), got
# the eager call then bound torch's registry and decided, as if nothing had traced
cells = dict(zip(dist.all_reduce.__code__.co_freevars, dist.all_reduce.__closure__))
assert type(_registry.current).__name__ != "_BeforeTorch", _registry.current
assert _registry.alone == "" and cells["_world"].cell_contents is _registry.current
print("compiled cold")
"""


def test_a_compiled_step_may_hold_the_processes_first_collectives():
    """The first collective binds torch's registry and decides whether a world of one is
    allowed, writing the collectives' closure cells; met while tracing, that write made
    dynamo fail with an internal AssertionError (load_cell) at the next collective."""
    assert run(["-c", COLD], timeout=120).stdout.strip() == "compiled cold"


@ranks(2, timeout=COMPILE_TIMEOUT)
def test_a_forked_child_cannot_compile_its_parents_collectives():
    # the graph would call the parent's group (its connections are the parent's) and wait
    # for ever: the trace stops at once instead, naming the rank the child came from
    from test_safe_default import _in_a_fork

    rank, _ = world()
    said = _in_a_fork(lambda: _compiled(lambda x: dist.all_reduce(x) * 2)(torch.ones(2)))
    assert f"this process was forked from rank {rank}" in said, said
    assert dist.all_reduce(torch.ones(1)).item() == 2  # the parents' world goes on
