"""`service.client` is the trainer's whole public face: at most 16 names, each documented, and the names it
exported before still resolve for one release with a DeprecationWarning."""

from __future__ import annotations

import importlib
import inspect
import warnings

import pytest

import service.client
from service.client import _FORMER


def test_at_most_16_public_names_each_documented_in_the_module_docstring() -> None:
    doc = service.client.__doc__ or ""
    assert 0 < len(service.client.__all__) <= 16
    undocumented = [name for name in service.client.__all__ if f"`{name}" not in doc]
    assert not undocumented, undocumented
    missing = [name for name in service.client.__all__ if not hasattr(service.client, name)]
    assert not missing, missing


def test_star_import_gives_exactly_the_public_names() -> None:
    namespace: dict = {}
    exec("from service.client import *", namespace)
    assert sorted(k for k in namespace if k != "__builtins__") == sorted(service.client.__all__)


@pytest.mark.parametrize("name", sorted(_FORMER))
def test_a_former_export_is_the_same_object_with_a_warning(name: str) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = getattr(service.client, name)
    assert got is getattr(importlib.import_module(_FORMER[name]), name)
    ((warning,),) = [caught]
    assert warning.category is DeprecationWarning and _FORMER[name] in str(warning.message)
    assert warning.filename == __file__  # it names the code that used the old name


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        service.client.no_such_name  # noqa: B018


def test_the_two_clients_declare_the_same_methods_in_plain_code() -> None:
    """Each method's parameters are written in its `def` (no wrapper builds them), and the twins agree."""
    sync, asyncio_ = service.client.RoutedExpertsClient, service.client.AsyncRoutedExpertsClient
    public = sorted(n for n in vars(sync) if not n.startswith("_") and callable(getattr(sync, n)))
    assert public == ["ack", "ack_many", "close", "engines", "fetch_bytes", "get", "get_many", "stream"]
    for name in public:
        if name == "close":
            continue
        blocking, coroutine = getattr(sync, name), getattr(asyncio_, name)
        assert not hasattr(blocking, "__wrapped__") and not hasattr(coroutine, "__wrapped__"), name
        assert inspect.signature(blocking).parameters == inspect.signature(coroutine).parameters, name
    assert list(inspect.signature(sync.get).parameters) == [
        "self", "rid", "start", "end", "layers", "wait", "clamp", "allow_suspect"
    ]  # fmt: skip
