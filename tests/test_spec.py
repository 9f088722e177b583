"""One spec per collective: the tables other layers used to keep are derived from it,
and what it declares holds."""

from __future__ import annotations

import inspect

import pytest
import torch

import distkit.dist as dist
from distkit.dist import _route
from distkit.dist.backends.base import Backend
from distkit.dist.core import spec
from distkit.dist.guard import debugmode


def test_every_backend_method_has_a_spec_and_every_spec_a_method():
    methods = {
        name for name, fn in vars(Backend).items() if getattr(fn, "__isabstractmethod__", False)
    }
    assert methods == set(spec.SPECS)
    assert all(s.method == name for name, s in spec.SPECS.items())


def test_the_tables_are_derived_from_the_specs():
    assert debugmode.MUST_MATCH is spec.MUST_MATCH
    assert set(_route._EAGER_METHODS) == set(spec.SPECS)
    assert "pickles objects" in spec.eager_reason("all_gather_object")
    assert "blocks" in spec.eager_reason("barrier")


#: A call of each collective with a single-process shortcut, with default arguments
CALLS = {
    "all_reduce": lambda f, t: f(t),
    "all_gather": lambda f, t: f(t),
    "gather": lambda f, t: f(t),
    "broadcast": lambda f, t: f(t),
    "reduce": lambda f, t: f(t),
    "barrier": lambda f, t: f(),
    "all_gather_object": lambda f, t: f({"loss": 0.5}),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_each_shortcut_returns_what_the_single_process_backend_does(name):
    public = getattr(dist, name)
    assert spec.SPECS[name].shortcut is not None
    assert "def factory" in public.__distkit_shortcut__  # the compiled guard is in front
    t = torch.arange(3.0)
    fast = CALLS[name](public, t)
    checked = CALLS[name](public.__wrapped__, t)  # arguments checked, then SINGLE
    assert type(fast) is type(checked)
    if isinstance(fast, torch.Tensor):
        assert fast is t and checked is t  # the caller's own tensor, in both
    elif isinstance(fast, list):
        assert len(fast) == len(checked) == 1
        assert fast[0] is checked[0] or fast == checked
    else:
        assert fast == checked


def test_the_shortcut_conditions_are_the_specs():
    returns, when = spec.shortcut_of("all_reduce", {"Tensor": torch.Tensor})
    assert returns == "data" and when["data"] is torch.Tensor and when["group"] is None
    params = inspect.signature(dist.all_reduce).parameters
    assert set(when) <= set(params)
