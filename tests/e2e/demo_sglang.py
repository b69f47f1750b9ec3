"""`make demo-sglang`: the whole path on a laptop, the same real CPU server the real-engine suite uses.

A real SGLang 0.5.23 server (tiny random-weight Qwen3-MoE, plugin loaded, sidecar mode with live rows on)
and a real `r3-sidecar serve` on the same spool; a few requests are sent, and the commands to fetch their
rows are printed. Ctrl-C stops both (by process group).
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sglang_server import Config, running


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None, help="model, spool and logs (default: a temp dir)")
    parser.add_argument("--requests", type=int, default=3)
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="r3-demo-sglang-"))
    config = Config("demo", env={"R3_MODE": "sidecar", "R3_LIVE_ROWS": "1"})
    print(f"starting SGLang 0.5.23 (CPU, tiny MoE) + r3-sidecar under {workdir} (about 20-60 s)…", flush=True)
    with running(config, workdir) as stack:
        print(f"SGLang  {stack.url}   (log: {stack.server.log})")
        print(f"sidecar {stack.sidecar_url}   (log: {stack.sidecar.log})\n")
        for i in range(args.requests):
            rid = f"demo-sglang-{i}"
            ids = [3 + (7 * i + 13 * k) % 250 for k in range(20 + 30 * i)]
            response = stack.generate(ids, rid=rid, return_routed_experts=True)
            meta = response["meta_info"]
            print(
                f"{rid}: {meta['prompt_tokens']} prompt + {meta['completion_tokens']} output tokens; "
                f"meta_info carries routed_experts_url={meta.get('routed_experts_url')!r} "
                f"and no inline payload: {'routed_experts' not in meta}"
            )
        rid = "demo-sglang-0"
        url = stack.sidecar_url
        print(
            "\nFetch the rows (each is a (rows, 4 layers, top-2) uint8 array):\n"
            f"  curl -s -o r.npy '{url}/routed_experts/{rid}'            # numpy.load('r.npy')\n"
            f"  curl -s '{url}/routed_experts/{rid}?format=json&start=0&end=3'\n"
            f"  curl -s '{url}/routed_experts/{rid}?format=sglang_b64'    # SGLang's inline bytes\n"
            f"  curl -s '{url}/v1/engines'                                 # the engine's buffer budget\n"
            f"  curl -s '{url}/metrics' | grep ^r3_\n"
            "Send more (live rows: stream them with ?stream=true while the request decodes):\n"
            f"  curl -s {stack.url}/generate -H 'content-type: application/json' -d "
            '\'{"rid": "mine", "input_ids": [5, 6, 7, 8], "return_routed_experts": true, '
            '"sampling_params": {"max_new_tokens": 64}}\'\n'
            "Ctrl-C stops the server and the sidecar.",
            flush=True,
        )
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        try:
            while not stop.wait(1.0):
                if not stack.server.alive():
                    sys.exit(f"SGLang exited; its log: {stack.server.log}")
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
