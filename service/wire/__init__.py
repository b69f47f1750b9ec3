"""What crosses HTTP between the sidecar and its clients, defined once for both sides (docs/design.md, Contract 2).

`formats`: the body formats (`npy`, `raw`, `json`, `sglang_b64`), layer selections and SGLang's dtypes; `frames`:
`application/vnd.r3.frames`; `node_identity`: the node a sidecar advertises and a client compares; `buffers`: the
buffers a body is read into. It imports neither the server nor the client.
"""
