"""Let a real SGLang server (0.5.12 to 0.5.23) run on a CPU-only torch, in every process it spawns: test support only.

Loaded from a `.pth` file (installed by `make env`, and into each older SGLang's venv by `make env-sglang-<v>`)
so that the main, tokenizer, scheduler and detokenizer processes all get it; inert unless
`R3_TEST_SGLANG_CPU=1`. Each patch is applied right after its module is imported (an import hook, so nothing
of SGLang is imported early), and only on the versions whose code needs it (read from the
imported SGLang's own `sglang.version`, not from whichever dist-info is first on the path: `_PATCHES`):

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
   accelerators only. From 0.5.20 on: 0.5.16 and 0.5.12 have neither `memcpy_cpu` nor
   `forward_batch_info._is_cpu`, and their venvs run no DP attention.
4. Before 0.5.20 (0.5.16, 0.5.12): the routed-experts host cache (`state_capturer.base.BaseHostCache`)
   allocates with `torch.zeros(..., pin_memory=True)` itself, not through `ALLOC_MEMORY_FUNCS`; that module's
   `torch` becomes one whose `zeros` leaves host memory unpinned. Before 0.5.18: under overlap scheduling (on by
   default) a forward's routed experts reach the host cache through `TopkCaptureOutput`, whose "copy to CPU"
   (`copy_to_cpu`, from 0.5.15 `map_device_tensors` with `.to("cpu", non_blocking=True)`) is a real copy from a
   GPU, ordered before the next forward on the same stream, but returns the capture buffer itself on a CPU. The
   next forward, run before the scheduler processes this one's result, overwrites it, so each decode row held
   the next token's routing and the last row whatever forward came next (seen 2026-11-29 on 0.5.13.post1's
   real server: with `--disable-overlap-schedule` the same rows one position earlier). 0.5.18 clones there
   itself; here the copy is made a copy, as on a GPU.
5. 0.5.12 only: `mem_cache.memory_pool_host` imports `sgl_kernel.kvcacheio` on every device but NPU, XPU and
   MPS (0.5.16 only on CUDA and HIP); PyPI's sgl_kernel is a CUDA build, not installed here. While that module
   executes, a `sgl_kernel.kvcacheio` whose functions raise stands in (nothing calls them without a
   hierarchical cache); it is gone afterwards, so everything else still sees no sgl_kernel.

The plugin's production code carries none of them: they are facts of this machine, not of SGLang on a GPU.

Test-only, and inert unless `R3_TEST_ZERO_LAYER=<layer>:<flag file>` is set (with `R3_TEST_SGLANG_CPU=1`; issue
40): while the flag file exists, `RoutedExpertsCapturer.capture` (0.5.23's `state_capturer.routed_experts`) is
handed zeros for that layer's ids, as a kernel that routes inside itself leaves the capture buffer: the model
still routes truly, the captured rows of that layer say "expert 0" for every token.
"""

import importlib.abc
import importlib.util
import os
import sys
import types
from collections.abc import Callable

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


class _UnpinnedTorch(types.ModuleType):
    """`torch` as one module sees it, except that `zeros` never pins (a CPU torch cannot)."""

    def __init__(self, torch: types.ModuleType) -> None:
        super().__init__("torch")
        self._torch = torch

    def __getattr__(self, name: str):
        return getattr(self._torch, name)

    def zeros(self, *args, pin_memory: bool = False, **kwargs):
        return self._torch.zeros(*args, **kwargs)


def _state_capturer_base(module) -> None:
    version = _sglang_version()
    if version < (0, 5, 20):
        module.torch = _UnpinnedTorch(module.torch)
    if version < (0, 5, 18):
        _copying_capture_output(module.TopkCaptureOutput)


def _copying_capture_output(cls) -> None:
    """`TopkCaptureOutput`'s copy to the host a copy on a CPU too (point 4 above)."""
    if hasattr(cls, "map_device_tensors"):  # 0.5.15 to 0.5.17
        mapped = cls.map_device_tensors

        def map_device_tensors(self, fn):
            return mapped(self, lambda tensor: fn(tensor).clone())

        cls.map_device_tensors = map_device_tensors
    else:  # 0.5.12 to 0.5.14
        copied = cls.copy_to_cpu

        def copy_to_cpu(self):
            copied(self)
            self.out_cache_loc, self.topk = self.out_cache_loc.clone(), self.topk.clone()

        cls.copy_to_cpu = copy_to_cpu


ZERO_LAYER_FLAG = "R3_TEST_ZERO_LAYER"


def _zero_one_layer(module) -> None:
    """Capture zeros for one layer while the flag file exists (test-only: `ZERO_LAYER_FLAG`)."""
    layer, _, flag = os.environ[ZERO_LAYER_FLAG].partition(":")
    cls = module.RoutedExpertsCapturer
    original = cls.capture

    def capture(self, layer_id, topk_indices):
        if layer_id == int(layer) and os.path.exists(flag):
            topk_indices = topk_indices.new_zeros(topk_indices.shape)
        return original(self, layer_id, topk_indices)

    cls.capture = capture


_KVCACHEIO = "sgl_kernel.kvcacheio"


def _kvcacheio_stub() -> dict[str, types.ModuleType]:
    """`sgl_kernel` and `sgl_kernel.kvcacheio` modules whose every function raises if called."""

    def missing(name: str) -> Callable[..., None]:
        def call(*args, **kwargs) -> None:
            raise RuntimeError(f"{_KVCACHEIO}.{name}: sgl_kernel is not installed (CPU test shim)")

        return call

    def attribute(name: str) -> Callable[..., None]:
        if name.startswith("__"):
            raise AttributeError(name)
        return missing(name)

    stub = types.ModuleType(_KVCACHEIO)
    stub.__getattr__ = attribute
    return {"sgl_kernel": types.ModuleType("sgl_kernel"), _KVCACHEIO: stub}


def _with_kvcacheio_stub(exec_module: Callable[[], None]) -> None:
    added = {name: m for name, m in _kvcacheio_stub().items() if name not in sys.modules}
    sys.modules.update(added)
    try:
        exec_module()
    finally:
        for name in added:
            sys.modules.pop(name, None)


def _sglang_version() -> tuple[int, ...]:
    """The version of the SGLang code being imported (its own `sglang/_version.py`)."""
    from sglang.version import __version__

    return tuple(int(part) for part in __version__.split(".")[:3] if part.isdigit())


def _plain_exec(exec_module: Callable[[], None]) -> None:
    exec_module()


class _Patch:
    """What one module gets: a wrapper around its execution, a patch after it, on versions in [since, before)."""

    def __init__(
        self,
        after: Callable[[types.ModuleType], None] | None = None,
        around: Callable[[Callable[[], None]], None] = _plain_exec,
        since: tuple[int, ...] = (),
        before: tuple[int, ...] | None = None,
    ) -> None:
        self.after, self.around, self.since, self.before = after, around, since, before

    def applies(self) -> bool:
        if not self.since and self.before is None:
            return True
        version = _sglang_version()
        return self.since <= version and (self.before is None or version < self.before)


_DP = (0, 5, 20)  # the DP-attention patches: the older versions lack what they set (memcpy_cpu, _is_cpu)


_PATCHES = {
    "sglang.srt.distributed.parallel_state": _Patch(_parallel_state, since=_DP),
    "sglang.srt.layers.dp_attention": _Patch(_dp_attention, since=_DP),
    "sglang.srt.model_executor.forward_batch_info": _Patch(_forward_batch_info, since=_DP),
    "sglang.srt.layers.attention.torch_native_backend": _Patch(_torch_native, since=_DP),
    "sglang.srt.layers.rotary_embedding.base": _Patch(_rotary),
    "sglang.srt.mem_cache.pool_host.common": _Patch(_pool_host),
    "sglang.srt.state_capturer.base": _Patch(_state_capturer_base, before=(0, 5, 20)),  # two patches: see it
    "sglang.srt.mem_cache.memory_pool_host": _Patch(around=_with_kvcacheio_stub, before=(0, 5, 16)),
}


class _PatchAfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Find the real spec, then wrap its loader so the patch runs once the module has executed."""

    def find_spec(self, fullname, path=None, target=None):
        patch = _PATCHES.get(fullname)
        if patch is None or not patch.applies():
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
                patch.around(lambda: real.exec_module(module))
                if patch.after is not None:
                    patch.after(module)

        spec.loader = _Loader()
        return spec


if os.environ.get(ZERO_LAYER_FLAG):
    _PATCHES["sglang.srt.state_capturer.routed_experts"] = _Patch(_zero_one_layer)

if os.environ.get(ENV_FLAG) == "1":
    sys.meta_path.insert(0, _PatchAfterImport())
