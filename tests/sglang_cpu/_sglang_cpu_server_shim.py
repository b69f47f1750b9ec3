"""Let a real SGLang 0.5.23 server run on a CPU-only torch, in every process it spawns: test support only.

Loaded from a `.pth` file (installed by `make env`) so that the main, tokenizer, scheduler and detokenizer
processes all get it; inert unless `R3_TEST_SGLANG_CPU=1`. Three kinds of patch, each applied right after its module
is imported (an import hook, so nothing of SGLang is imported early):

1. `sglang.srt.layers.rotary_embedding.base._is_cpu = True`: otherwise `RotaryEmbedding.__init__` imports
   `vllm._custom_ops` (SGLang's own CPU engine needs sgl_kernel's CPU build, which PyPI does not carry).
2. `sglang.srt.mem_cache.pool_host.common.ALLOC_MEMORY_FUNCS["cpu"]` → an unpinned allocation: the default
   pins through `cudaHostRegister`, which a CPU torch does not have.
3. DP attention pads each rank's batch in `ForwardBatch.prepare_mlp_sync_batch`, which pins host memory and
   asks the attention backend for a padding fill value unless `forward_batch_info._is_cpu` (true only under
   SGLang's own CPU engine); `torch_native`, the backend SGLang picks here, implements neither hook. So:
   `forward_batch_info._is_cpu = True` (touches only those two lines) and the CPU fill value 1 (as SGLang's
   Intel AMX CPU backend returns) on `TorchNativeAttnBackend`; and the DP gather's row copy takes SGLang's
   own CPU path (`dp_attention.memcpy_cpu`) instead of a Triton kernel, which has no CPU driver, and the
   group collectives (`all_gather_into_tensor`, `reduce_scatter_tensor`) take SGLang's own CPU branches
   (`parallel_state._is_cpu`: plain torch.distributed on gloo) instead of custom ops registered for
   accelerators only.

The plugin's production code carries none of them: they are facts of this machine, not of SGLang on a GPU.
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


def _forward_batch_info(module) -> None:
    module._is_cpu = True


def _torch_native(module) -> None:
    module.TorchNativeAttnBackend.get_cpu_graph_seq_len_fill_value = lambda self: 1


def _dp_attention(module) -> None:
    module.memcpy_func = module.memcpy_cpu


def _parallel_state(module) -> None:
    module._is_cpu = True


_PATCHES = {
    "sglang.srt.distributed.parallel_state": _parallel_state,
    "sglang.srt.layers.dp_attention": _dp_attention,
    "sglang.srt.model_executor.forward_batch_info": _forward_batch_info,
    "sglang.srt.layers.attention.torch_native_backend": _torch_native,
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
