"""How long a hostile request can freeze the gateway's other streams (issue 18): the largest gap between the
SSE chunks of one innocent streaming chat, quiet and while someone sends (a) a chat prompt just under the
8 MiB body cap, (b) a flood of 200 ``/health`` probes, (c) both.

    python load_tests/event_loop_stall.py [--code DIR] [--label NAME] [--out FILE]

The gateway runs in a process of its own (``LocalBackend`` over a random tiny Llama, each decode step held
``--step-ms`` like a swarm step, so the stream lasts while the hostile requests are served) with the code in
``--code`` (default: this checkout; another worktree measures an older commit with the same script). The
hostile requests come from a second process, so neither they nor the reader share this process's GIL.
Gaps are measured between arrivals of content chunks, from the 20th chunk on; with hostile load, over the
chunks that arrived from its start until it was answered.

Appends one record per run (code, commit, per scenario: max / median / p99 gap, chunks, the hostile
requests' status codes and time) to ``--out`` (JSON list).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
CAP = 8 * 2**20  # settings.max_body_bytes by default
PROBES = 200
WARMUP_CHUNKS = 20

#: the gateway process: LocalBackend whose steps take ``step_s`` (a swarm step), default settings
SERVE = """
import sys, threading, time
import torch, uvicorn
from gateway import GatewaySettings, LocalBackend, create_app

model, port, step_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
torch.set_num_threads(1)

class Slow:
    def __init__(self, inner):
        self.inner = inner
    def __getattr__(self, name):
        return getattr(self.inner, name)
    def step(self, ids):
        time.sleep(step_s)
        return self.inner.step(ids)

class Backend:
    def __init__(self, inner):
        self.inner = inner
        self.model_id, self.tokenizer, self.max_context = inner.model_id, inner.tokenizer, inner.max_context
        self.generation_config = inner.generation_config
    def open_session(self, max_length, session_id=None):
        return Slow(self.inner.open_session(max_length, session_id))
    def swarm_state(self):
        return self.inner.swarm_state()
    def close(self):
        self.inner.close()

uvicorn.run(create_app(Backend(LocalBackend(model))), host="127.0.0.1", port=port, log_level="warning")
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tiny_model(root: Path) -> Path:
    sys.path.insert(0, str(ROOT))
    from swarm_client.tiny_model import make_tiny_model

    return make_tiny_model(root / "tiny-llama", family="llama", num_layers=4, seed=0)


def _start_gateway(code: Path, model: Path, port: int, step_s: float) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(code)}
    proc = subprocess.Popen([sys.executable, "-c", SERVE, str(model), str(port), str(step_s)], cwd=code, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the gateway exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the gateway did not come up")


# ---------------------------------------------------------------------------------------------- hostile


def _big_body(model: str) -> bytes:
    head = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": ""}]}
    room = CAP - len(json.dumps(head)) - 64
    words = "hello world, a hostile prompt. "
    body = {**head, "messages": [{"role": "user", "content": words * (room // len(words))}]}
    data = json.dumps(body).encode()
    assert CAP - 128 < len(data) <= CAP
    return data


def _hostile(url: str, model: str, kinds: list[str], ready: Any, go: Any, results: Any) -> None:
    """In a process of its own: wait for ``go``, then send ``kinds`` (``big``, ``health``) at once; report
    what came back and when it started and ended (``time.monotonic``: one clock for every process)."""
    from concurrent.futures import ThreadPoolExecutor

    data = _big_body(model) if "big" in kinds else b""
    ready.set()
    go.wait()
    out: dict[str, Any] = {"started": time.monotonic()}
    with httpx.Client(base_url=url, timeout=600, limits=httpx.Limits(max_connections=64)) as http:

        def big() -> None:
            t = time.monotonic()
            r = http.post("/v1/chat/completions", content=data, headers={"content-type": "application/json"})
            out["big"] = {"status": r.status_code, "seconds": round(time.monotonic() - t, 3)}

        def probe(_: int) -> int:
            return http.get("/health").status_code

        with ThreadPoolExecutor(40) as pool:
            pending = pool.submit(big) if "big" in kinds else None
            if "health" in kinds:
                t = time.monotonic()
                codes = list(pool.map(probe, range(PROBES)))
                out["health"] = {"probes": PROBES, "ok": codes.count(200), "seconds": round(time.monotonic() - t, 3)}
            if pending is not None:
                pending.result()
    out["ended"] = time.monotonic()
    results.put(out)


# ------------------------------------------------------------------------------------------ the stream


def _gaps_ms(times: list[float]) -> dict[str, Any]:
    gaps = sorted((b - a) * 1000 for a, b in zip(times, times[1:], strict=False))
    if not gaps:
        return {"chunks": len(times)}
    return {
        "chunks": len(times),
        "max_gap_ms": round(gaps[-1], 2),
        "median_gap_ms": round(statistics.median(gaps), 2),
        "p99_gap_ms": round(gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], 2),
    }


def scenario(url: str, model: str, kinds: list[str], quiet_chunks: int) -> dict[str, Any]:
    """One innocent stream; ``kinds`` of hostile load start after its warm-up chunks (none: quiet)."""
    ctx = multiprocessing.get_context("spawn")
    ready, go, results = ctx.Event(), ctx.Event(), ctx.Queue()
    proc = None
    if kinds:
        proc = ctx.Process(target=_hostile, args=(url, model, kinds, ready, go, results), daemon=True)
        proc.start()
        ready.wait(120)
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 1900,
        "stream": True,
        "logit_bias": {"0": -100, "2": -100},  # the tiny model's EOS ids: the stream goes on
    }
    times: list[float] = []
    hostile: dict[str, Any] = {}
    with httpx.Client(base_url=url, timeout=600) as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if not any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                continue
            times.append(time.monotonic())
            if len(times) == WARMUP_CHUNKS and proc is not None:
                go.set()
            if proc is None and len(times) >= WARMUP_CHUNKS + quiet_chunks:
                break
            if proc is not None and not hostile and not results.empty():
                hostile = results.get()
            if hostile and times[-1] > hostile["ended"] + 0.5:
                break
    if proc is None:
        return {"hostile": [], **_gaps_ms(times[WARMUP_CHUNKS:])}
    if not hostile:
        hostile = results.get(timeout=600)
    proc.join(30)
    start, end = hostile.pop("started"), hostile.pop("ended")
    # from the last chunk before the hostile requests to the first after they were answered
    before = [t for t in times if t <= start][-1:]
    after = [t for t in times if t >= end][:1]
    measured = before + [t for t in times if start < t < end] + after
    return {
        "hostile": kinds,
        **_gaps_ms(measured),
        "hostile_seconds": round(end - start, 3),
        "stream_outlasted_it": bool(after),
        "requests": hostile,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--code", type=Path, default=ROOT, help="checkout whose gateway is measured")
    parser.add_argument("--label", default="", help="name of this run in the results (default: the commit)")
    parser.add_argument("--step-ms", type=float, default=10.0, help="time each decode step is held")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "bench_results" / "event-loop-stall.json")
    args = parser.parse_args()

    commit = subprocess.run(
        ["git", "-C", str(args.code), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="stall-") as tmp:
        model = _tiny_model(Path(tmp))
        port = _free_port()
        gateway = _start_gateway(args.code.resolve(), model, port, args.step_ms / 1000)
        url = f"http://127.0.0.1:{port}"
        name = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        runs = []
        try:
            for _ in range(args.repeats):
                for kinds in ([], ["big"], ["health"], ["big", "health"]):
                    result = scenario(url, name, kinds, quiet_chunks=300)
                    print(json.dumps(result), flush=True)
                    runs.append(result)
        finally:
            gateway.terminate()
            gateway.wait(10)
    record = {
        "label": args.label or commit,
        "commit": commit,
        "step_ms": args.step_ms,
        "cpus": os.cpu_count(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "scenarios": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    existing = json.loads(args.out.read_text()) if args.out.exists() else []
    args.out.write_text(json.dumps([*existing, record], indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
