"""Interpret-only compiler stub (TEST ONLY): every compile step refuses."""

from triton.backends.compiler import BaseBackend

_MSG = (
    "triton-interp-cpu is an interpret-only stub: set TRITON_INTERPRET=1 (it cannot compile Triton kernels for the CPU)"
)


class InterpretOnlyCPUBackend(BaseBackend):
    @staticmethod
    def supports_target(target):
        return getattr(target, "backend", None) == "cpu"

    def hash(self) -> str:
        return "triton-interp-cpu-0.1.0"

    def parse_options(self, options):
        raise RuntimeError(_MSG)

    def add_stages(self, stages, options, language):
        raise RuntimeError(_MSG)

    def load_dialects(self, context):
        raise RuntimeError(_MSG)

    def get_module_map(self):
        raise RuntimeError(_MSG)
