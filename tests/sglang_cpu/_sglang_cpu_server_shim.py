"""Let a real SGLang 0.5.23 server run on a CPU-only torch, in every process it spawns: test support only.

Loaded from a `.pth` file (installed by `make env`) so that the main, tokenizer, scheduler and detokenizer
processes all get it; inert unless `R3_TEST_SGLANG_CPU=1`. Two patches, each applied right after its module
is imported (an import hook, so nothing of SGLang is imported early):

1. `sglang.srt.layers.rotary_embedding.base._is_cpu = True`: otherwise `RotaryEmbedding.__init__` imports
   `vllm._custom_ops` (SGLang's own CPU engine needs sgl_kernel's CPU build, which PyPI does not carry).
2. `sglang.srt.mem_cache.pool_host.common.ALLOC_MEMORY_FUNCS["cpu"]` → an unpinned allocation: the default
   pins through `cudaHostRegister`, which a CPU torch does not have.

The plugin's production code carries neither: they are facts of this machine, not of SGLang on a GPU.
"""

import importlib.abc
import importlib.util
import os
import sys

ENV_FLAG = "R3_TEST_SGLANG_CPU"


def _rotary(module) -> None:
    module._is_cpu = True


def _pool_host(module) -> None:
    def unpinned(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
        return allocator.allocate(dims, dtype=dtype, device=device)

    module.ALLOC_MEMORY_FUNCS["cpu"] = unpinned


_PATCHES = {
    "sglang.srt.layers.rotary_embedding.base": _rotary,
    "sglang.srt.mem_cache.pool_host.common": _pool_host,
}


class _PatchAfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Find the real spec, then wrap its loader so the patch runs once the module has executed."""

    def find_spec(self, fullname, path=None, target=None):
        patch = _PATCHES.get(fullname)
        if patch is None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        real = spec.loader

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return real.create_module(spec)

            def exec_module(self, module):
                real.exec_module(module)
                patch(module)

        spec.loader = _Loader()
        return spec


if os.environ.get(ENV_FLAG) == "1":
    sys.meta_path.insert(0, _PatchAfterImport())
