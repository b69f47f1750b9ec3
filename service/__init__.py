"""r3-sidecar's service: serves the routed-experts spool to RL trainers over HTTP (no torch, no SGLang).

`spool` is the file contract shared with the engine; `store` indexes it; `formats` encodes bodies;
`api` is the FastAPI app (`create_app`); `metrics` the Prometheus view; `client`/`cli` the trainer side.
"""
