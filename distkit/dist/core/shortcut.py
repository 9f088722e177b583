"""Shortcuts: the hottest calls skip argument resolution when there is nothing to resolve.

``all_reduce(t)`` runs in every training step, and in a single process it must cost
little more than a function call. :func:`shortcut` compiles, in front of a collective,
a guard made only of identity and exact-type tests of the arguments it declares
(``group is None``, ``async_op is False``, ``data.__class__ is Tensor``) and of the one
question "is there a process group?", read from :data:`distkit._registry.current` like
everywhere else. When the guard holds it returns the single-process result at once;
otherwise the decorated function (the *checked path*: argument checks, then
:func:`distkit.dist._route.resolve`, then a backend) runs.

A guard only accepts trivially valid arguments (a test of identity can fail spuriously,
and then the checked path runs, but never accept a bad value), so the shortcut and the
checked path cannot disagree; ``tests/test_agreement.py`` runs every bad argument of
every public function with and without a process group to hold that line. One exception,
chosen for speed: a tensor's class is all a guard tests, so a sparse, MKL-DNN, quantized,
nested or meta tensor (class ``Tensor`` too) passes a single process's no-op unchanged,
while every call with a process group raises the ``TypeError`` of
:func:`distkit.dist.core.args.dense` (reading the layout would double the no-op's cost).

Torch-free: :mod:`distkit.dist.world` uses it before torch is imported.
"""

from __future__ import annotations

import inspect
import sys
import types
from typing import Any, Callable, Optional, TypeVar

from distkit import _registry

F = TypeVar("F", bound=Callable[..., Any])

#: What a checked path raises for arguments it refuses (see ``refused`` of :func:`shortcut`)
_REFUSABLE = (TypeError, ValueError, RuntimeError)


def _test(name: str, condition: Any, bind: Callable[[Any], str]) -> str:
    """Source of one condition on parameter ``name``; ``bind`` names a closure value."""
    if condition is None or condition is True or condition is False:
        return f"{name} is {condition}"
    if isinstance(condition, tuple):
        return "(" + " or ".join(_test(name, c, bind) for c in condition) + ")"
    if isinstance(condition, type):
        return f"{name}.__class__ is {bind(condition)}"
    if isinstance(condition, frozenset):  # type(), not .__class__: torch.compile's tracer
        # answers `1 .__class__ in {int}` wrongly (False) while tracing (torch 2.13, 2.14)
        return f"type({name}) in {bind(condition)}"
    if callable(condition):
        return f"{bind(condition)}({name})"
    if isinstance(condition, str):  # user code's literal "sum" is this very object
        condition = sys.intern(condition)
    return f"{name} is {bind(condition)}"


def shortcut(
    returns: Optional[str],
    world: Optional[str] = None,
    lane: Optional[tuple[Any, ...]] = None,
    collective: bool = True,
    refused: Optional[Callable[[str, BaseException, Any], None]] = None,
    **when: Any,
) -> Callable[[F], F]:
    """Compile a shortcut in front of the checked function it decorates.

    Args:
        returns: Expression of the parameters to return when every condition holds and
            there is no process group (``"data"``, ``"[data]"``, ``"0"``); ``None`` for
            a call that has no single-process result (``send``: there is no other rank),
            whose checked path then runs and raises.
        world: Expression to return when every condition holds and a process group
            ``pg`` exists (``"pg.rank()"``); ``None`` lets the checked path run then.
        lane: ``(name, condition, fn)`` or ``(name, condition, fn, miss)``: when every
            condition holds, a process group exists and parameter ``name`` meets
            ``condition`` too, ``fn(the parameters without a default, in order, the
            default group)`` runs, and what it returns is the result unless it is
            ``miss`` (``None`` unless given; then the checked path runs). For a
            many-rank call common enough to skip the checked path's layers (see
            :attr:`distkit.dist.backends.tensors.TorchBackend.lane`).
        collective: Whether the function is a collective: its guard then reads "is
            there a process group?" through :func:`distkit._registry.guard`, so that a
            launched process without one takes the checked path (which raises) instead
            of returning the single-process result. Queries (``world`` given) are not.
        refused: ``refused(name, error, group)`` is called when the checked path raises
            a ``TypeError``, ``ValueError`` or ``RuntimeError`` (then the error is
            raised): how a collective tells the other ranks that this rank refused its
            arguments (:func:`distkit.dist.guard.watch.refused`). A ``try`` costs
            nothing until something is raised. With neither ``returns`` nor ``lane``,
            the function gets this and no shortcut.
        **when: Parameter name to condition: a value compared by identity (``None``,
            ``False``, ``0``, ``"sum"``), a type (the argument's exact class), a
            frozenset of types, a predicate, or a tuple of conditions one of which must
            hold. Only trivially valid values belong here.

    Returns:
        A decorator; the function it returns has the decorated function's signature,
        docstring and module, and the decorated function as ``__wrapped__``.
    """

    assert returns is not None or lane is not None or refused is not None, "nothing to do"

    def compile_(checked: F) -> F:
        sig = inspect.signature(checked)
        closure: dict[str, Any] = {"_checked": checked, "_world": _registry.current}

        def bind(value: Any) -> str:
            name = f"_c{len(closure)}"
            closure[name] = value
            return name

        # Keyword-only parameters (``grad``) become ordinary trailing ones here: CPython
        # calls a function that has any keyword-only parameter through its slow path
        # (about 25 ns more per call). They still reach the checked function by keyword,
        # and its signature (``inspect.signature`` follows ``__wrapped__``) is the one
        # users and type checkers see.
        params, call = [], []
        for p in sig.parameters.values():
            if p.kind is p.KEYWORD_ONLY and p.default is p.empty and "*" not in params:
                params.append("*")  # a required keyword cannot trail defaults
            params.append(p.name if p.default is p.empty else f"{p.name}={bind(p.default)}")
            call.append(f"{p.name}={p.name}" if p.kind is p.KEYWORD_ONLY else p.name)
        tests = [_test(name, cond, bind) for name, cond in when.items()] or ["True"]
        body = [f"        if {' and '.join(tests)}:"]
        if returns is None and lane is None:
            body = []
        elif lane is not None:
            name, condition, fn = lane[:3]
            miss = bind(lane[3]) if len(lane) > 3 else "None"
            required = [p.name for p in sig.parameters.values() if p.default is p.empty]
            body += ["            pg = _world._default_pg"]
            if returns is None:  # no single-process result: the checked path raises
                body += ["            if pg is not None and " + _test(name, condition, bind) + ":"]
            else:
                body += [
                    "            if pg is None:",
                    f"                return {returns}",
                    f"            if {_test(name, condition, bind)}:",
                ]
            body += [
                f"                done = {bind(fn)}({', '.join([*required, 'pg'])})",
                f"                if done is not {miss}:",
                "                    return done",
            ]
        elif world is None:
            body[0] = body[0][:-1] + " and _world._default_pg is None:"
            body.append(f"            return {returns}")
        else:
            body += [
                "            pg = _world._default_pg",
                f"            return {returns} if pg is None else {world}",
            ]
        run = f"_checked({', '.join(call)})"
        if refused is None:
            tail = [f"        return {run}"]
        else:
            tail = [
                "        try:",
                f"            return {run}",
                f"        except {bind(_REFUSABLE)} as exc:",
                f"            {bind(refused)}({checked.__name__!r}, exc, group)",
                "            raise",
            ]
        source = "\n".join(
            [
                f"def factory({', '.join(closure)}):",
                f"    def {checked.__name__}({', '.join(params)}):",
                *body,
                *tail,
                f"    return {checked.__name__}",
            ]
        )
        namespace: dict[str, Any] = {}
        exec(compile(source, f"<distkit shortcut of {checked.__name__}>", "exec"), namespace)
        inner = namespace["factory"](*closure.values())
        cells = dict(zip(inner.__code__.co_freevars, inner.__closure__ or ()))
        # it follows the registry once torch is loaded (and the launcher guard)
        if "_world" in cells:  # (a function with no shortcut reads no world)
            _registry.watch(cells["_world"], collective=collective and world is None)
        # Home the function in the collective's module, so that tools looking for a
        # module's own functions (doctest, pickling by name) find it there.
        fast = types.FunctionType(
            inner.__code__,
            checked.__globals__,
            checked.__name__,
            inner.__defaults__,
            inner.__closure__,
        )
        fast.__kwdefaults__ = inner.__kwdefaults__
        fast.__doc__ = checked.__doc__
        fast.__module__ = checked.__module__
        fast.__qualname__ = checked.__qualname__
        fast.__annotations__ = checked.__annotations__
        fast.__wrapped__ = checked  # type: ignore[attr-defined]
        fast.__distkit_shortcut__ = source  # type: ignore[attr-defined]
        return fast  # type: ignore[return-value]

    return compile_
