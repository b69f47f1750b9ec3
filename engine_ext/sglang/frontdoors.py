"""Every way a trainer reaches SGLang gets its rows inline or a pointer to them: plain values, no SGLang.

- Where the pointer can be attached (one tokenizer process that loads the plugin: `/generate`, the
  OpenAI-compatible endpoints, offline `sglang.Engine`, several DP schedulers behind the DP controller),
  sidecar mode drops the inline payload and the response carries `routed_experts_url` instead: in
  `meta_info`, and in the OpenAI responses' `sglext` object (`sglext_pointer`, `PointerStream`).
- Where it cannot (`pointer_unreachable`: SGLang does not load plugins in its multi-tokenizer HTTP
  workers, nor in the process 0.5.12's HTTP/2 server (Granian) spawns, nor do those have a hook point),
  sidecar mode keeps SGLang's inline payload, as mirror mode does (`effective_mode`): the trainer gets its
  rows inline, and the spool still gets the record.
- Wherever the rows go inline (mirror mode, a refused spool, several tokenizer workers or Granian's: their hooks
  come with `http_worker`, on ≤ 0.5.20 through `worker_app`), the response also says their shape and start
  (`inline_shape`; in a stream, the chunk that carries the rows), so a trainer decodes SGLang's flat string
  without the model's numbers.
- Where neither can work (`layout_refusal`: capture-all for requests that do not ask, when no pointer can
  reach them) the launch is refused under `R3_BUDGET=enforce`, naming the setting to change.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from engine_ext.core.records import routed_experts_url
from engine_ext.core.settings import Mode

MULTI_TOKENIZER = (
    "--tokenizer-worker-num {n} > 1: SGLang does not load plugins in its tokenizer worker processes, which "
    "build the responses, so no pointer can be attached there"
)
GRANIAN_WORKER = (
    "--enable-http2 on SGLang {version}: Granian serves the API from a process it spawns, which builds the "
    "responses and loads no plugins, so no pointer can be attached there"
)
RUST_SERVER = "SGLANG_RUST_SERVER=1: responses are built outside SGLang's Python tokenizer manager"
RUST_SERVER_NOTE = (
    "SGLANG_RUST_SERVER is on: SGLang's HTTP server, tokenizer manager and detokenizer run in Rust, so the "
    "plugin's front-door hooks never run, and SGLang's Rust egress carries no routed experts either. Still "
    "works: capture and the spool (the scheduler is still Python; the sidecar serves records by rid). Does not: "
    "routed_experts_url pointers and inline rows in responses. Fetch each request's rows by its rid (send your "
    "own rid), or unset SGLANG_RUST_SERVER for pointers"
)


def rust_server_note(rust_server: bool, mode: Mode) -> str | None:
    """What works and what does not under SGLang's Rust front end (None: it is off, or the plugin is)."""
    return RUST_SERVER_NOTE if rust_server and mode is not Mode.OFF else None


def pointer_unreachable(
    *, tokenizer_worker_num: int, rust_server: bool = False, granian_worker: str | None = None
) -> str | None:
    """Why responses of this layout cannot carry `routed_experts_url` (None: they can). `granian_worker`: the
    SGLang version when its HTTP/2 server builds even one worker's responses in a spawned process."""
    if tokenizer_worker_num > 1:
        return MULTI_TOKENIZER.format(n=tokenizer_worker_num)
    if granian_worker:
        return GRANIAN_WORKER.format(version=granian_worker)
    if rust_server:
        return RUST_SERVER
    return None


def effective_mode(mode: Mode, unreachable: str | None) -> Mode:
    """Sidecar mode keeps SGLang's inline payload (mirror) where no pointer can reach the trainer."""
    return Mode.MIRROR if mode is Mode.SIDECAR and unreachable else mode


def pointing_mode(mode: Mode, proven: bool) -> Mode:
    """The mode the main process attaches pointers by. On a build no test proved, the scheduler keeps SGLang's
    inline rows until its check agrees (`build_check`), which the main process cannot see: so every response
    that asked gets the pointer beside whatever rows it carries, as in mirror mode."""
    return Mode.MIRROR if mode is Mode.SIDECAR and not proven else mode


def layout_refusal(*, mode: Mode, capture_all: bool, unreachable: str | None) -> str | None:
    """A layout that cannot work at all: requests that do not ask get neither rows nor a pointer."""
    if mode is Mode.OFF or not capture_all or not unreachable:
        return None
    return (
        f"r3-sidecar: R3_CAPTURE_ALL=1 cannot deliver here: {unreachable}, and a request that does not carry "
        "return_routed_experts gets no inline rows either. Set --tokenizer-worker-num 1 (and unset "
        "SGLANG_RUST_SERVER), or unset R3_CAPTURE_ALL and have trainers send return_routed_experts=true "
        "(their rows then come inline)."
    )


def delivery_report(configured: Mode, unreachable: str | None, front_door: str | None = None) -> dict[str, str | None]:
    """The engine file's `delivery` part: the mode asked for, the mode in effect, and why they differ;
    `front_door` (only when set) says what a front end the hooks cannot reach leaves working."""
    report = {
        "mode": str(effective_mode(configured, unreachable)),
        "configured_mode": str(configured),
        "inline_kept": unreachable if effective_mode(configured, unreachable) is not configured else None,
    }
    return report | ({"front_door": front_door} if front_door else {})


def pointer_rids(rids: list[str], asked: list[bool], refused: frozenset[str]) -> frozenset[str]:
    """The rids of one batch of outputs whose responses get `routed_experts_url`.

    Those that asked for routed experts (`asked`), except the `refused` ones (`refused_rids`): their pointer
    could only answer 404 after the trainer's whole `wait`, and their rows are in the response instead.
    """
    return frozenset(rid for rid, wants in zip(rids, asked, strict=True) if wants and rid not in refused)


def refused_rids(rids: list[str], asked: list[bool], inline: list[object] | None, mode: Mode) -> frozenset[str]:
    """The rids of one batch whose rows the spool refused, in sidecar mode: those that asked and still carry
    SGLang's inline payload (sidecar mode drops it only once the spool has accepted the rows: full, writer
    queue full, not writable). Mirror mode keeps both rows and pointer: none is refused."""
    if mode is not Mode.SIDECAR or not inline:
        return frozenset()
    return frozenset(
        rid
        for i, (rid, wants) in enumerate(zip(rids, asked, strict=True))
        if wants and i < len(inline) and inline[i] is not None
    )


def inline_shape(payload: object, *, num_hidden_layers: int, topk: int, start_len: int) -> dict[str, object] | None:
    """`meta_info`'s `routed_experts_shape` (`[rows, num_hidden_layers, topk]`) and `routed_experts_start_len` for
    an output that carries SGLang's inline rows (its base64 string, or the tensor of `skip_tokenizer_init`).

    SGLang's string is int32 rows of `num_hidden_layers * topk` values, flat: without these a trainer must know
    the model to shape it. None when there are no rows, or their size does not divide into that row width.
    """
    width = num_hidden_layers * topk
    if payload is None or (isinstance(payload, str) and not payload):
        return None
    if isinstance(payload, str):
        nbytes = len(payload) * 3 // 4 - payload[-2:].count("=")
        values = nbytes // 4 if nbytes % 4 == 0 else -1
    else:
        values = int(getattr(payload, "numel", lambda: -1)())
    if width <= 0 or values <= 0 or values % width:
        return None
    return {"routed_experts_shape": [values // width, num_hidden_layers, topk], "routed_experts_start_len": start_len}


# ---- the OpenAI-compatible endpoints: `sglext.routed_experts_url(s)` ------------------------------


def sglext_pointer(urls: list[str | None]) -> dict[str, object] | None:
    """The `sglext` fields for the choices' pointers (choice order), or None when no choice has one.

    `routed_experts_url` is the first choice's, beside upstream's `routed_experts` (the first choice's
    rows); `routed_experts_urls` holds one per choice, for `n > 1`.
    """
    if not any(urls):
        return None
    return {"routed_experts_url": next(u for u in urls if u), "routed_experts_urls": list(urls)}


@dataclass
class PointerStream:
    """Adds the pointers to an OpenAI-compatible SSE stream (`data: {json}\\n\\n` chunks, then `[DONE]`), and
    the shape and start of the inline rows to the chunk that carries them.

    Each chunk's `id` is the rid of the choice (`choices[].index`) it carries, so the stream itself says which
    rid each choice has. The pointers go into the response-level `sglext` chunk when SGLang sends one (mirror
    mode: the inline rows), else into a chunk of their own, `choices: []`, right before `data: [DONE]`. That
    `sglext` chunk's `routed_experts` (SGLang's flat string) gets `routed_experts_shape` and
    `routed_experts_start_len` beside it (`shape_of`, e.g. `inline_shape` with the model's numbers bound).
    """

    base_url: str | None  # None: no pointers (no sidecar configured, or none can be reached), shapes only
    n: int
    object_name: str  # "text_completion" | "chat.completion.chunk"
    model: str | None
    shape_of: Callable[[str], dict[str, object] | None] | None = None
    rids: dict[int, str] = field(default_factory=dict)
    done: bool = False
    _last: dict | None = None

    def urls(self) -> list[str | None]:
        count = max(self.n, max(self.rids, default=-1) + 1)
        base = self.base_url
        return [routed_experts_url(base, self.rids[i]) if base and i in self.rids else None for i in range(count)]

    def feed(self, chunk: str) -> list[str]:
        """The chunks to send for one chunk of SGLang's stream."""
        if self.done or not isinstance(chunk, str):
            return [chunk]
        if chunk.startswith("data: [DONE]"):
            self.done = True
            extra = self._pointer_chunk()
            return [extra, chunk] if extra else [chunk]
        obj = self._parsed(chunk)
        if obj is None:
            return [chunk]
        self._last = obj
        self._note_rids(obj)
        if isinstance(obj.get("sglext"), dict) and not obj.get("choices"):
            return self._into_sglext(obj) or [chunk]
        return [chunk]

    def _parsed(self, chunk: str) -> dict | None:
        """A data chunk's JSON, where it can name a pointer's rid or carries an `sglext`; None: pass it as it is."""
        if not chunk.startswith("data: {"):
            return None
        wants_ids = bool(self.base_url) and len(self.rids) < self.n  # the rids name the pointers
        if not (wants_ids or '"sglext"' in chunk):
            return None
        try:
            obj = json.loads(chunk[len("data: ") :])
        except ValueError:
            return None
        return obj if isinstance(obj, dict) else None

    def _note_rids(self, obj: dict) -> None:
        """Each choice's rid: the chunk's `id`, for its `choices[].index`."""
        rid = obj.get("id")
        for choice in obj.get("choices") or ():
            if isinstance(rid, str) and isinstance(choice, dict) and isinstance(choice.get("index"), int):
                self.rids.setdefault(choice["index"], rid)

    def _into_sglext(self, obj: dict) -> list[str] | None:
        """SGLang's own response-level `sglext` chunk with the pointers and the inline rows' shape (None: neither)."""
        pointer = sglext_pointer(self.urls())
        rows = obj["sglext"].get("routed_experts")
        shape = self.shape_of(rows) if self.shape_of and isinstance(rows, str) else None
        if pointer:
            self.done = True  # the pointers went out with SGLang's own sglext chunk
        if not (pointer or shape):
            return None
        obj["sglext"].update((shape or {}) | (pointer or {}))
        return [f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"]

    def _pointer_chunk(self) -> str | None:
        pointer = sglext_pointer(self.urls())
        if pointer is None:
            return None
        last = self._last or {}
        obj = {
            "id": self.rids.get(0) or last.get("id"),
            "object": self.object_name,
            "created": last.get("created"),
            "model": self.model if self.model is not None else last.get("model"),
            "choices": [],
            "sglext": pointer,
        }
        return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
