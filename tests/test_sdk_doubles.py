"""The Daytona and E2B SDK doubles (tests/chain/daytona_double.py, e2b_double.py) against the installed SDKs, as
tests/test_hub_contract.py checks the Hub double: a call the real client would refuse, or a result it would not
return, fails here instead of on a user's first SANDBOX=daytona|e2b job.

Every public method of a double takes exactly the real method's parameters (names, kinds, defaults), and every type
it is annotated to return is one the real method (or one of its overloads) is annotated to return; a double's sandbox
stands for the SDK's sandbox class. The names the doubles replace are the ones Harbor's environments import from the
SDKs (tests/chain/serve.py checks them again in the env server before it swaps them). tests/test_chain_backends.py
runs Harbor's real environments on the doubles.
"""

from __future__ import annotations

import importlib
import inspect
import typing

import daytona
import e2b
import pytest
from chain import daytona_double, e2b_double, serve
from daytona._async.filesystem import AsyncFileSystem
from daytona._async.process import AsyncProcess
from e2b.sandbox_async.commands.command import Commands
from e2b.sandbox_async.filesystem.filesystem import Filesystem

PAIRS = {daytona_double.AsyncDaytona: daytona.AsyncDaytona, daytona_double.AsyncSandbox: daytona.AsyncSandbox,
         daytona_double.AsyncProcess: AsyncProcess, daytona_double.AsyncFileSystem: AsyncFileSystem,
         e2b_double.AsyncSandbox: e2b.AsyncSandbox, e2b_double.AsyncTemplate: e2b.AsyncTemplate,
         e2b_double.Commands: Commands, e2b_double.Filesystem: Filesystem}
METHODS = [(double, name) for double in PAIRS for name, member in vars(double).items()
           if not name.startswith("_") and callable(getattr(double, name))]


def shape(function: object) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


def returned(function: object, owner: type) -> set[object]:
    """The classes `function` (and its overloads) is annotated to return, a double's sandbox read as the SDK's."""
    found: set[object] = set()
    for variant in [function, *typing.get_overloads(getattr(function, "__func__", function))]:
        hint = typing.get_type_hints(variant).get("return")
        for part in typing.get_args(hint) if isinstance(hint, typing.types.UnionType) else [hint]:
            part = owner if part is typing.Self else PAIRS.get(part, part)
            found.add(typing.get_origin(part) or part)
    return found - {None}


@pytest.mark.parametrize(("double", "name"), METHODS, ids=[f"{d.__module__.split('.')[-1]}.{d.__name__}.{n}"
                                                         for d, n in METHODS])
def test_each_double_method_takes_exactly_the_real_parameters_and_returns_the_real_types(double, name):
    real = PAIRS[double]
    assert hasattr(real, name), f"{real.__qualname__} has no {name}"
    assert shape(getattr(double, name)) == shape(getattr(real, name))
    expected = returned(getattr(real, name), real)
    if expected:  # an unannotated real method (daytona's close, stop) says nothing to hold the double to
        assert returned(getattr(double, name), real) <= expected


def test_the_doubles_replace_what_harbors_environments_import_from_the_sdks():
    for harbor_module, names in serve.SDK_DOUBLES.items():
        module = importlib.import_module(harbor_module)
        for name, (sdk, double) in names.items():
            assert getattr(module, name) is getattr(importlib.import_module(sdk), name)
            assert PAIRS[getattr(importlib.import_module(double), name)] is getattr(module, name)
    assert importlib.import_module("harbor.environments.daytona.environment")._HAS_DAYTONA
    assert importlib.import_module("harbor.environments.e2b")._HAS_E2B


def test_a_doubles_refusal_is_the_sdks_own_error_for_that_status():
    from chain.daytona_double import create_daytona_error
    from daytona.common.errors import DaytonaRateLimitError
    from e2b.exceptions import NotFoundException, RateLimitException, SandboxException

    assert isinstance(create_daytona_error("x", status_code=429), DaytonaRateLimitError)  # Harbor retries this class
    assert isinstance(e2b_double.api_error(429, "x"), RateLimitException)
    assert isinstance(e2b_double.api_error(404, "x"), SandboxException)  # create's 404: the SDK's default class
    assert isinstance(e2b_double.missing("/nope"), NotFoundException)
