"""Import SGLang 0.5.23 with CUDA visible but without its CUDA kernel package `sgl_kernel`.

On a GPU machine with PyTorch but no SGLang wheels of its own (the device machine this workplace lends: no
network, 64 MiB of carry, while `sgl_kernel` is hundreds of MB and must match the image's torch), SGLang's
modules take their CUDA branches and import names from it at module level. The capture path under test
never calls them, so the missing package resolves to a placeholder module: every name in it imports, and
any call raises `NotImplementedError`, so no result can rest on one. An installed `sgl_kernel` is used as is.
On `PYTHONPATH`, Python imports this file at start (child interpreters too).
"""

import importlib.abc
import importlib.machinery
import sys
import types

# SGLang 0.5.23 imports `sgl_kernel` unguarded once CUDA is visible; its other kernel packages (flashinfer,
# deep_gemm, ...) it imports guarded or lazily, so their absence takes SGLang's own no-package branches.
PACKAGES = frozenset({"sgl_kernel"})
TOUCHED: list[str] = []  # the placeholder names imported, for the log


class _Missing:
    """A name from an absent kernel package: calling it (or anything reached through it) raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError(f"{self._name}: a placeholder, the kernel package is not installed")

    def __getattr__(self, item: str) -> "_Missing":
        if item.startswith("__"):
            raise AttributeError(item)
        return _Missing(f"{self._name}.{item}")


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, item: str) -> _Missing:
        if item.startswith("__"):
            raise AttributeError(item)
        TOUCHED.append(f"{self.__name__}.{item}")
        return _Missing(f"{self.__name__}.{item}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] not in PACKAGES:
            return None
        for finder in sys.meta_path:
            if finder is not self and _finds(finder, fullname, path, target):
                return None  # installed: the real package
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = _PlaceholderModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        TOUCHED.append(module.__name__)


def _finds(finder, fullname, path, target) -> bool:
    try:
        return finder.find_spec(fullname, path, target) is not None
    except (ImportError, AttributeError, ValueError):
        return False


sys.meta_path.insert(0, _Finder())
