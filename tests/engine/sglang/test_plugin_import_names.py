"""`plugin_imports`: the SGLang names the plugin's modules import, per layout, as the wheels' test checks them."""

from __future__ import annotations

import ast
import textwrap

import plugin_imports

from engine_ext.sglang import compat


def test_a_shims_imports_count_only_where_the_layout_calls_that_shim():
    """0.5.12 reads `cuda_graph_config` through `compat_shims.graph_config_from_flags`, which imports the global
    ServerArgs getter; 0.5.23 calls no shim that imports from SGLang."""
    shim = ("compat_shims", "sglang.srt.server_args", "get_global_server_args")
    assert shim in plugin_imports.needed_by(compat.LAYOUTS["0.5.12"])
    assert shim not in plugin_imports.needed_by(compat.LAYOUTS[compat.NEWEST])
    assert ("hooks.table", "sglang.srt.plugins.hook_registry", "HookRegistry") in plugin_imports.needed_by(
        compat.LAYOUTS[compat.NEWEST]
    )


def test_an_import_whose_absence_is_caught_is_optional():
    tree = ast.parse(
        textwrap.dedent(
            """
            from sglang.srt.a import needed
            def hook():
                from sglang.srt.b import used
                try:
                    from sglang.srt.c import maybe
                except ImportError:
                    from sglang.srt.d import fallback
            """
        )
    )
    assert plugin_imports.imports(tree) == [
        (None, "sglang.srt.a", "needed"),
        ("hook", "sglang.srt.b", "used"),
        ("hook", "sglang.srt.d", "fallback"),
    ]
