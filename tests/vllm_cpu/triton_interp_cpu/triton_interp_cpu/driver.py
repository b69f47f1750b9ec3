"""Interpret-only driver stub (TEST ONLY): never active, never launches."""

from triton.backends.driver import DriverBase

_MSG = "triton-interp-cpu is an interpret-only stub: set TRITON_INTERPRET=1 (it has no CPU launcher)"


class InterpretOnlyCPUDriver(DriverBase):
    @classmethod
    def is_active(cls):
        # Inactive on purpose: Triton's own driver selection is left exactly as without this
        # package. vLLM does not ask is_active() of a backend named "cpu"
        # (vllm/triton_utils/importing.py:30-42); it only checks that the name is registered.
        return False

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise RuntimeError(_MSG)

    def get_current_target(self):
        raise RuntimeError(_MSG)

    def get_active_torch_device(self):
        raise RuntimeError(_MSG)

    def get_benchmarker(self):
        raise RuntimeError(_MSG)
