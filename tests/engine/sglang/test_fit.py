"""`fit`: which layout a build gets is decided by what the build has; its version string only orders the tries.

The pure parts here (the order of candidates, the signature rule, the first fitting layout); each installed
SGLang's own answer is `tests/e2e/test_sglang_versions.py` (every venv, its own modules and source).
"""

from __future__ import annotations

import pytest

from engine_ext.sglang import compat, fit

LAYOUTS = ("0.5.23", "0.5.20", "0.5.16", "0.5.12")


@pytest.mark.parametrize(
    ("found", "order"),
    [
        ("0.5.23", ["0.5.23", "0.5.20", "0.5.16", "0.5.12"]),
        ("0.5.16", ["0.5.16", "0.5.12", "0.5.20", "0.5.23"]),
        ("0.5.12.post1", ["0.5.12", "0.5.16", "0.5.20", "0.5.23"]),  # a post release comes after its release
        ("0.5.15.post1", ["0.5.12", "0.5.16", "0.5.20", "0.5.23"]),
        ("0.5.17.dev3+g1a2b3c4", ["0.5.16", "0.5.12", "0.5.20", "0.5.23"]),  # a dev build comes before it
        ("0.5.20.dev0", ["0.5.16", "0.5.12", "0.5.20", "0.5.23"]),
        ("0.6.1", ["0.5.23", "0.5.20", "0.5.16", "0.5.12"]),
        ("not-a-version", ["0.5.23", "0.5.20", "0.5.16", "0.5.12"]),
        (None, ["0.5.23", "0.5.20", "0.5.16", "0.5.12"]),
    ],
)
def test_candidates_go_nearest_first_at_or_below_then_above(found, order):
    assert fit.candidates(found, LAYOUTS) == order


def test_the_first_candidate_that_fits_is_applied_and_the_others_are_not_tried():
    tried = []

    def lacking(version, rows):
        tried.append(version)
        return [] if version == "0.5.16" else [f"{version}-only name"]

    got = fit.fit("0.5.15.post1", [], lacking)
    order = fit.candidates("0.5.15.post1", compat.LAYOUTS)
    assert got.layout == "0.5.16" and tried == order[: order.index("0.5.16") + 1]
    assert got.lacking == {v: ([] if v == "0.5.16" else [f"{v}-only name"]) for v in tried}
    assert compat.layout().version == compat.NEWEST  # the caller applies the layout, not the check


def test_no_fitting_candidate_leaves_none_and_every_gap():
    got = fit.fit("0.5.18", [], lambda version, rows: [f"{version} gap"])
    assert got.layout is None and list(got.lacking) == fit.candidates("0.5.18", compat.LAYOUTS)


class Target:
    def method(self, batch, result): ...
    def wider(self, batch, result, extra=None): ...
    def renamed(self, result, batch): ...
    def keyword_only(self, *, model_config, num_tokens): ...


def around(original, self, batch, result): ...
def around_open(original, self, batch, result, *args, **kwargs): ...
def around_runner(original, runner, batch, *args, **kwargs): ...
def around_keywords(original, *args, **kwargs): ...
def replacement(self, batch, result): ...


@pytest.mark.parametrize(
    ("target", "body", "replace", "keywords", "gap"),
    [
        (Target.method, around, False, (), None),
        (Target.method, replacement, True, (), None),
        (Target.method, around_runner, False, (), None),  # the first parameter may name `self` otherwise
        (Target.wider, around_open, False, (), None),  # the rest passes through *args/**kwargs
        (Target.wider, around, False, (), "more than the hook passes on"),
        (Target.renamed, around, False, (), "parameter 1 is 'result' where the hook binds 'batch'"),
        (Target.keyword_only, around_keywords, False, ("model_config",), None),
        (Target.keyword_only, around_keywords, False, ("max_running_requests",), "has no parameter"),
        (Target.keyword_only, around, False, (), "takes 1 positional parameters"),
        (max, around, False, (), None),  # a builtin without a signature: nothing to compare
    ],
)
def test_a_hook_binds_a_target_only_with_the_parameters_it_reads(target, body, replace, keywords, gap):
    found = fit.signature_gap(target, body, replace, keywords)
    assert (found is None) if gap is None else (found is not None and gap in found), found


def test_every_hook_row_binds_its_0_5_23_target():
    """On the installed SGLang (0.5.23 in .venv) every row's hook binds the target's parameters as it reads them."""
    import pkgutil

    from engine_ext.sglang.hooks.table import HOOKS, REPLACE, body

    for row in HOOKS:
        if "hip" in row.groups:
            continue
        gap = fit.signature_gap(pkgutil.resolve_name(row.target), body(row.function), row.type is REPLACE, row.keywords)
        assert gap is None, (row.target, gap)


def test_a_layout_that_checks_the_budget_at_resolution_needs_the_registrar(monkeypatch):
    """0.5.19 has a resolution pipeline but no `arg_groups.resolution_hooks`: a layout that registers the budget
    check there must not fit it (its real server's `register` failed on that import before this check)."""
    monkeypatch.setattr(compat, "RESOLUTION_HOOK", "sglang.srt.arg_groups.no_such_module.register_resolution_hook")
    previous = compat.layout().version
    try:
        compat.use("0.5.23")
        assert compat.RESOLUTION_HOOK in compat.unresolved([])
        compat.use("0.5.16")  # no budget check at resolution: the registrar is not needed
        assert compat.RESOLUTION_HOOK not in compat.unresolved([])
    finally:
        compat.use(previous)
    assert not compat.LAYOUTS["0.5.19"].budget_at_resolution
