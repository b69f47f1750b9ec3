"""`source_names` and `wheel_fit` on a small made-up wheel: each way a name is found, or not, as an import would.

Why: the release wheels' test (`test_release_wheels.py`) passes when every release fits its row, which a reader
that found everything would too; these cases show what it reports missing, and that a signature read from a `def`
goes through `fit.signature_gap` as a live one does.
"""

from __future__ import annotations

import textwrap
import zipfile

import pytest
import wheel_fit
from source_names import CLASS, FUNCTION, INSTANCE, MODULE, OPAQUE, Found, Missing, Source, returned, signature

from engine_ext.sglang import fit

FILES = {
    "sglang/__init__.py": "",
    "sglang/srt/__init__.py": "",
    "sglang/srt/base.py": """
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from sglang.srt.only_typed import Hidden
        class Base:
            limit = 3
            def inherited(self, batch, result): ...
        class Config:
            size: int
            def __init__(self):
                self.made = 1
        def get_config() -> "Config": ...
        def get_hidden() -> Hidden: ...
        """,
    "sglang/srt/runner.py": """
        from .base import Base as Renamed
        import sglang.srt.base as base_module
        class Runner(Renamed):
            def forward(self, batch, *, extra): ...
            @classmethod
            def create(cls, config, size): ...
        def helper(x, /, y, *args, **kwargs): ...
        settings = base_module.Config()
        anything = 1 + 2
        """,
    "sglang/srt/reexport.py": "from sglang.srt.runner import *\nfrom os import path as os_path\n",
    "sglang/srt/lazy.py": "def __getattr__(name): ...\n",
    "sglang/srt/space/inner.py": "def here(): ...\n",  # a namespace package: no __init__.py
}


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Source:
    path = tmp_path_factory.mktemp("wheel") / "sglang-0.0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, text in FILES.items():
            wheel.writestr(name, textwrap.dedent(text))
    return Source(zipfile.Path(path, "sglang/"))


@pytest.mark.parametrize(
    ("dotted", "kind", "where"),
    [
        ("sglang.srt.runner", MODULE, "sglang.srt.runner"),
        ("sglang.srt.space.inner.here", FUNCTION, "sglang.srt.space.inner.here"),
        ("sglang.srt.runner.Runner.forward", FUNCTION, "sglang.srt.runner.Runner.forward"),
        ("sglang.srt.runner.Runner.inherited", FUNCTION, "sglang.srt.base.Base.inherited"),  # a base, imported renamed
        ("sglang.srt.runner.Runner.limit", OPAQUE, "sglang.srt.base.Base.limit"),  # a class-level value
        ("sglang.srt.reexport.Runner", CLASS, "sglang.srt.runner.Runner"),  # through a * import
        ("sglang.srt.reexport.os_path", OPAQUE, "os.path"),  # not SGLang's: present, members unknown
        ("sglang.srt.runner.settings", INSTANCE, "sglang.srt.base.Config"),  # `Cls()` through a module alias
        ("sglang.srt.runner.settings.size", OPAQUE, "sglang.srt.base.Config.size"),  # a field
        ("sglang.srt.runner.anything.real", OPAQUE, "sglang.srt.runner.anything.real"),
        ("sglang.srt.lazy.whatever", OPAQUE, "sglang.srt.lazy.whatever"),  # a module __getattr__
    ],
)
def test_a_name_is_found_where_an_import_would_find_it(source, dotted, kind, where):
    found = source.resolve(dotted)
    assert isinstance(found, Found) and (found.kind, found.dotted) == (kind, where), found


@pytest.mark.parametrize(
    ("dotted", "name"),
    [
        ("sglang.srt.nothing.x", "nothing"),
        ("sglang.srt.runner.Runner.backward", "backward"),
        ("sglang.srt.runner.settings.unset", "unset"),  # neither a class-level name nor set by a constructor
        ("sglang.srt.base.Hidden", "Hidden"),  # bound only for type checkers
    ],
)
def test_a_name_that_is_not_there_is_missing_at_its_first_absent_part(source, dotted, name):
    found = source.resolve(dotted)
    assert isinstance(found, Missing) and found.name == name, found


def test_a_constructor_assignment_is_an_instance_attribute(source):
    assert isinstance(source.resolve("sglang.srt.runner.settings.made"), Found)


@pytest.mark.parametrize(
    ("dotted", "text"),
    [
        ("sglang.srt.runner.Runner.forward", "(self, batch, *, extra)"),
        ("sglang.srt.runner.Runner.create", "(config, size)"),  # a classmethod, bound
        ("sglang.srt.runner.helper", "(x, /, y, *args, **kwargs)"),
    ],
)
def test_a_def_gives_the_signature_inspect_would(source, dotted, text):
    assert str(signature(source.resolve(dotted))) == text


def test_a_getter_returns_the_class_its_annotation_names_unless_only_type_checkers_see_it(source):
    assert returned(source, source.resolve("sglang.srt.base.get_config")) == "sglang.srt.base.Config"
    assert returned(source, source.resolve("sglang.srt.base.get_hidden")) is None  # get_type_hints fails there


def around(original, self, result, batch, *args, **kwargs): ...


def test_a_signature_read_from_source_meets_fits_rule(source):
    stub = wheel_fit._stub(source.resolve("sglang.srt.runner.Runner.inherited"))
    assert "parameter 1 is 'batch' where the hook binds 'result'" in fit.signature_gap(stub, around, False)
    keyword = wheel_fit._stub(source.resolve("sglang.srt.runner.Runner.forward"))
    assert fit.signature_gap(keyword, around, False, ("extra",)) is not None  # takes 1 positional past self
    assert fit.signature_gap(wheel_fit._stub(source.resolve("sglang.srt.runner.anything")), around, False) is None


def test_settings_classes_answer_attributes_as_fit_does(source):
    assert wheel_fit.has_attribute(source, "sglang.srt.base.Config", "size") is True  # a field
    assert wheel_fit.has_attribute(source, "sglang.srt.base.Config", "made") is True  # its constructor sets it
    assert wheel_fit.has_attribute(source, "sglang.srt.base.Config", "other") is False
    assert wheel_fit.has_attribute(source, "sglang.srt.base.Nothing", "other") is None
