"""The sidecar: serves a spool's records to trainers over HTTP (docs/design.md, Contracts 2 and 3).

`api.create_app(settings)` is the FastAPI app; `store` indexes the spool, `fetch`/`stream`/`batch`/`ack` answer
the routes, `metrics` is the Prometheus view, `cli` the `r3-sidecar` command, `demo` an engine stand-in.
It imports the spool contract and the wire format, never the engine package, and the trainer client only inside
`r3-sidecar fetch` (the command line's client).
"""
