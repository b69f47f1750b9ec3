"""Engine-agnostic parts of the plugin: every adapter (`engine_ext.sglang`, `engine_ext.vllm`) builds on these.

Nothing here imports an engine or names its internals; adapters hand these modules plain values.
"""
