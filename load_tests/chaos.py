"""Chaos run: concurrent greedy chats through one gateway while a replicated span's workers keep dying.

    python load_tests/chaos.py                                  # tiny model, 16 streams, 5 min, kill every 30 s
    python load_tests/chaos.py --streams 2 --duration 9 --kill-every 5 --final-wait 0   # one kill, ~1 min

Swarm (``ReplicatedSwarm``, a ``served_swarm.ServedSwarm``): the model's blocks split in two spans, the first
served by one worker, the second by ``--replicas`` workers (default 2), and the in-process gateway. First a
fault-free pass sends every prompt once (greedy, EOS banned by ``logit_bias``, exactly ``--max-tokens``
tokens): those texts are the references. Then ``--streams`` streams send streaming chats back to back for
``--duration`` seconds (``loadgen``'s request loop and SSE parsing) while, every ``--kill-every`` seconds,
the replica of the second span that carries the most sessions (``--victim busiest``; ``oldest`` for strict
turns) is SIGKILLed with its process group (worker, its DHT process and p2pd: a machine failing) and a new
worker for the same span is started at once. In our runs the streams gathered on one replica (routing
prefers the lower RTT); killing it moved them to the other, which the next kill hit: the kills alternated
between the replicas and every kill landed on live streams (the victim's session count is reported). A kill
waits until the previous replacement is ready and visible to the gateway (the span always keeps a server);
that wait is reported.

Checks: no request failed, and every request's text equals its prompt's reference. Per kill it measures
- stall: the longest gap between two content events (request sent or a content chunk) straddling the kill,
  over the requests in flight at that moment — how long the streams the kill hit stood still;
- restart ready / routable: kill → the new worker's ready line, and → the gateway's DHT view lists it.
Writes ``--out`` (JSON) and a Markdown summary next to it; exit code 0 when the checks pass.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from load_tests.chaos_pressure import BanRecorder, CpuBurn  # noqa: E402
from load_tests.chaos_report import markdown  # noqa: E402
from load_tests.loadgen import PROMPTS, RequestResult, _one_request, percentile, prompt_index  # noqa: E402
from load_tests.served_swarm import OFFLINE, ServedSwarm, eos_logit_bias, resolve_model  # noqa: E402
from swarmserve.launcher import LocalSwarm, WorkerProcess, split_blocks, wait_ready  # noqa: E402

_START = time.monotonic()


def say(text: str) -> None:
    print(f"[{time.monotonic() - _START:6.1f}s] {text}", flush=True)


@dataclass
class Kill:
    index: int
    at_s: float  # seconds since the chaos phase began
    victim: str
    victim_peer: str | None
    victim_sessions: int | None  # sessions attached on the victim just before the kill (None: no answer)
    waited_for_restart_s: float  # how long this kill was held back for the previous replacement
    replacement: str = ""
    restart_ready_s: float | None = None
    restart_routable_s: float | None = None
    restart_error: str | None = None
    in_flight: int = 0
    stall_s: float | None = None
    stalls_s: list[float] = field(default_factory=list)


def _body(model: str, prompt: str, max_tokens: int, bias: Mapping[str, float]) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logit_bias": dict(bias),
    }


def _events(r: RequestResult, sent: float) -> list[float]:
    """The request's send time and its content chunks' times (same clock as ``sent``)."""
    if r.ttft_s is None:
        return [sent]
    times = [sent, sent + r.ttft_s]
    for gap in r.itl_s:
        times.append(times[-1] + gap)
    return times


def stalls_at(kill_s: float, done: Sequence[tuple[RequestResult, float]]) -> list[float]:
    """For each request in flight at ``kill_s``: the gap between its last event before and first after."""
    out = []
    for r, sent in done:
        times = _events(r, sent)
        before = [t for t in times if t <= kill_s]
        after = [t for t in times if t > kill_s]
        if before and after and sent <= kill_s:
            out.append(after[0] - before[-1])
    return out


class ReplicatedSwarm(ServedSwarm):
    """``ServedSwarm`` whose last span is served by ``replicas`` workers: all workers start at once (one
    torch thread each), then the gateway; ``replicated`` lists the last span's workers, oldest first."""

    def __init__(self, model_dir: Path, replicas: int, *, parts: int = 2, ready_timeout: float = 600.0):
        self.model_dir = Path(model_dir)
        args = ["--cache-tokens", "16384", "--update-period", "2", "--throughput", "1000"]
        self.swarm = LocalSwarm(self.model_dir, threads=1, worker_args=args, env=OFFLINE, grace=5.0)
        self.workers = self.swarm.workers
        self._stack = ExitStack()
        self._stack.callback(self.swarm.close)
        try:
            spans = split_blocks(self.swarm.num_blocks, parts)
            spans += [spans[-1]] * (replicas - 1)
            started = [
                self.swarm.add_worker(
                    blocks=span, name=f"worker {i + 1}" if i < parts - 1 else f"replica {i - parts + 2}", wait=False
                )
                for i, span in enumerate(spans)
            ]
            wait_ready(started, ready_timeout)
            self.replicated = started[parts - 1 :]
            say(f"swarm: {', '.join(f'{w.name} {w.span_text}' for w in started)} ready")
            self.server, self.backend = self._stack.enter_context(self._gateway({}, {}))
            say(f"gateway: {self.server.url}")
        except BaseException:
            self.close()
            raise


def _routable(swarm: ServedSwarm, peer_id: str | None) -> bool:
    from swarm_client import runtime
    from swarm_client.dht_records import ServerState

    spans = runtime.run(swarm.backend.manager.update(force=True), timeout=10.0)
    span = spans.get(peer_id) if peer_id else None
    return span is not None and span.server_info.state == ServerState.ONLINE


class Chaos:
    def __init__(self, swarm: ReplicatedSwarm, args: argparse.Namespace):
        self.swarm, self.args = swarm, args
        self.replicas: list[WorkerProcess] = list(swarm.replicated)
        self.span = self.replicas[0].span
        self.count = len(self.replicas)
        self.kills: list[Kill] = []
        self.restart: asyncio.Task | None = None
        self.stop = threading.Event()  # set: a replacement still loading is no longer waited for

    def _start_replica(self, wait: bool) -> WorkerProcess:
        self.count += 1
        w = self.swarm.swarm.add_worker(blocks=self.span, name=f"replica {self.count}", wait=wait, timeout=600)
        self.replicas.append(w)
        return w

    async def wait_visible(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not all([await asyncio.to_thread(_routable, self.swarm, w.peer_id) for w in self.replicas]):
            if time.monotonic() > deadline:
                raise RuntimeError("the replicas did not all show up in the gateway's view of the swarm")
            await asyncio.sleep(0.5)

    async def _restart(self, kill: Kill, t0: float) -> None:
        w = await asyncio.to_thread(self._start_replica, False)
        kill.replacement = w.name
        try:
            await asyncio.to_thread(wait_ready, [w], 600.0, stop=self.stop)
        except (InterruptedError, RuntimeError) as e:  # not waited for any more / it failed to start
            kill.restart_error = f"{type(e).__name__}: {e}"[:300]
            return
        kill.restart_ready_s = round(time.perf_counter() - t0 - kill.at_s, 3)
        while not await asyncio.to_thread(_routable, self.swarm, w.peer_id):
            await asyncio.sleep(0.25)
        kill.restart_routable_s = round(time.perf_counter() - t0 - kill.at_s, 3)
        took = f"ready {kill.restart_ready_s:.1f}s, routable {kill.restart_routable_s:.1f}s"
        say(f"{w.name} {took} after kill {kill.index}")

    def _sessions(self, w: WorkerProcess) -> int | None:
        try:
            return int(self.swarm.backend.server_info(w.peer_id, 2.0).get("sessions_attached") or 0)
        except Exception:
            return None

    async def killer(self, t0: float) -> None:
        n = 1
        while n * self.args.kill_every < self.args.duration:
            await asyncio.sleep(max(0.0, t0 + n * self.args.kill_every - time.perf_counter()))
            held = time.perf_counter()
            if self.restart is not None:
                await self.restart  # the span keeps a live server: the last replacement must be up first
            counts = [await asyncio.to_thread(self._sessions, w) for w in self.replicas]
            pick = 0
            if self.args.victim == "busiest":  # the replica most streams run through (ties: the oldest)
                pick = max(range(len(counts)), key=lambda i: (counts[i] or 0, -i))
            victim, sessions = self.replicas.pop(pick), counts[pick]
            at = time.perf_counter() - t0
            await asyncio.to_thread(victim.kill)
            self.swarm.workers.remove(victim)
            kill = Kill(n, round(at, 3), victim.name, victim.peer_id, sessions, round(time.perf_counter() - held, 3))
            self.kills.append(kill)
            say(f"t={at:6.1f}s  kill {n}: SIGKILL {victim.name} ({sessions} sessions)")
            self.restart = asyncio.create_task(self._restart(kill, t0))
            n += 1


async def run(swarm: ReplicatedSwarm, args: argparse.Namespace) -> dict[str, Any]:
    chaos = Chaos(swarm, args)
    await chaos.wait_visible()
    bias = eos_logit_bias(swarm.backend)
    limits = httpx.Limits(max_connections=args.streams + 4, max_keepalive_connections=args.streams + 4)
    timeout = httpx.Timeout(args.request_timeout, connect=10.0)
    async with httpx.AsyncClient(base_url=swarm.url, timeout=timeout, limits=limits) as client:
        model = str((await client.get("/v1/models")).json()["data"][0]["id"])
        prompts = PROMPTS[: args.prompts]

        # fault-free references, as many at once as the chaos phase will send
        refs: list[RequestResult] = [RequestResult(0, i, i, 0.0) for i in range(len(prompts))]
        t_ref = time.perf_counter()
        bodies = [_body(model, p, args.max_tokens, bias) for p in prompts]
        await asyncio.gather(*(_one_request(client, b, r, t_ref) for b, r in zip(bodies, refs, strict=True)))
        bad = [r.error for r in refs if not r.ok]
        if bad:
            raise RuntimeError(f"the fault-free reference pass failed: {bad[:3]}")
        reference = [r.text for r in refs]
        say(f"references: {len(reference)} prompts, {args.max_tokens} tokens each")

        done: list[tuple[RequestResult, float]] = []
        t0 = time.perf_counter()

        async def stream(s: int) -> None:
            i = 0
            while time.perf_counter() - t0 < args.duration:
                p = prompt_index(s, i, args.streams, len(prompts))
                sent = time.perf_counter() - t0
                r = RequestResult(stream=s, index=i, prompt_index=p, start_s=sent)
                await _one_request(client, _body(model, prompts[p], args.max_tokens, bias), r, t0)
                done.append((r, sent))
                i += 1

        say(f"chaos: {args.streams} streams for {args.duration:.0f}s, kill every {args.kill_every:.0f}s")
        recorder = BanRecorder().attach()  # the in-process gateway client's ban decisions
        with CpuBurn(args.cpu_burn) as burn:
            killer = asyncio.create_task(chaos.killer(t0))
            await asyncio.gather(*(stream(s) for s in range(args.streams)))
            wall = time.perf_counter() - t0
            await killer
            if chaos.restart is not None:  # the last replacement's recovery times (unless --final-wait 0)
                try:
                    await asyncio.wait_for(asyncio.shield(chaos.restart), args.final_wait)
                except (TimeoutError, InterruptedError):
                    chaos.stop.set()
                    await asyncio.gather(chaos.restart, return_exceptions=True)
            # afterwards, still under the same load: does the gateway serve normally (no wedge)?
            after = [RequestResult(0, i, i % len(prompts), 0.0) for i in range(args.after_requests)]
            t_after = time.perf_counter()
            await asyncio.gather(*(_one_request(client, bodies[r.prompt_index], r, t_after) for r in after))
        recorder.detach()

    for kill in chaos.kills:
        kill.stalls_s = [round(x, 4) for x in stalls_at(kill.at_s, done)]
        kill.in_flight = len(kill.stalls_s)
        kill.stall_s = max(kill.stalls_s, default=None)
    failed = [r for r, _ in done if not r.ok]
    mismatched = [r for r, _ in done if r.ok and r.text != reference[r.prompt_index]]
    itls = [g for r, _ in done if r.ok for g in r.itl_s]
    tokens = sum(r.tokens for r, _ in done if r.ok)
    stalls = [k.stall_s for k in chaos.kills if k.stall_s is not None]
    ready = [k.restart_ready_s for k in chaos.kills if k.restart_ready_s is not None]
    routable = [k.restart_routable_s for k in chaos.kills if k.restart_routable_s is not None]

    def stat(xs: list[float]) -> dict[str, float | None]:
        return {"median_s": round(statistics.median(xs), 3) if xs else None, "max_s": round(max(xs), 3) if xs else None}

    return {
        "requests": len(done),
        "failed": len(failed),
        "mismatched": len(mismatched),
        "texts_equal": not mismatched,
        "error_samples": sorted({r.error or "" for r in failed})[:10],
        "mismatch_samples": [
            {"prompt": r.prompt_index, "got": r.text, "want": reference[r.prompt_index]} for r in mismatched[:5]
        ],  # fmt: skip
        "completion_tokens": tokens,
        "wall_s": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 2) if wall else 0.0,
        "itl_p50_ms": round(1000 * (percentile(itls, 50) or 0), 2),
        "itl_p99_ms": round(1000 * (percentile(itls, 99) or 0), 2),
        "kills": len(chaos.kills),
        "stall": stat(stalls),
        "restart_ready": stat(ready),
        "restart_routable": stat(routable),
        "per_kill": [asdict(k) for k in chaos.kills],
        "references": reference,
        "gateway_open_sessions_after": swarm.backend.open_sessions,
        "cpu": burn.as_dict(),
        "bans": (bans := recorder.summary({k.victim_peer for k in chaos.kills if k.victim_peer})),
        "after": (
            after_ok := {
                "requests": len(after),
                "ok": sum(r.ok for r in after),
                "texts_equal": all(r.text == reference[r.prompt_index] for r in after if r.ok),
                "slowest_s": round(max((r.end_s - r.start_s for r in after), default=0.0), 3),
                "errors": sorted({r.error or "" for r in after if not r.ok})[:5],
            }
        ),
        "passed": not failed
        and not mismatched
        and bool(chaos.kills)
        and bool(done)
        and bans["healthy_escalations"] == 0
        and after_ok["ok"] == len(after)
        and after_ok["texts_equal"],
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="tiny | medium | smollm | local path (default: tiny)")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--duration", type=float, default=300.0, help="seconds of load (default: 5 minutes)")
    p.add_argument("--kill-every", type=float, default=30.0, help="seconds between SIGKILLs")
    p.add_argument("--replicas", type=int, default=2, help="workers serving the second span")
    p.add_argument(
        "--victim", choices=("busiest", "oldest"), default="busiest",
        help="which replica dies: the one with the most sessions (default; the replacement and the survivor "
        "then take turns) or the oldest (strict alternation, which may hit a replica no stream uses)",
    )  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many of loadgen's prompts to use")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument(
        "--final-wait", type=float, default=600.0,
        help="after the streams end, wait this long for the last replacement to be ready (0: do not)",
    )  # fmt: skip
    p.add_argument("--cpu-burn", type=int, default=0, help="busy processes beside the swarm (issue 35: load ≥ 10)")
    p.add_argument("--after-requests", type=int, default=4, help="requests sent once the chaos is over")
    p.add_argument("--out", type=Path, default=ROOT / "bench_results" / "chaos.json")
    args = p.parse_args(argv)
    if args.replicas < 2:
        p.error("--replicas must be at least 2: a kill must leave the span a live server")

    workdir = Path(tempfile.mkdtemp(prefix="swarmserve-chaos-"))
    loadavg_start = round(os.getloadavg()[0], 2)
    try:
        model_dir = resolve_model(args.model, workdir)
        # every worker gets one thread: the replicas and the restarts share the same cores
        with ReplicatedSwarm(model_dir, args.replicas) as swarm:
            import torch

            torch.set_num_threads(1)
            spans = [w.span_text for w in swarm.workers]
            report = asyncio.run(run(swarm, args))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report["meta"] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": args.model,
        "streams": args.streams,
        "duration_s": args.duration,
        "kill_every_s": args.kill_every,
        "replicas": args.replicas,
        "spans": spans,
        "replicated_span": spans[-1],
        "max_tokens": args.max_tokens,
        "cpu_count": os.cpu_count(),
        "loadavg_start": loadavg_start,
        "loadavg_end": round(os.getloadavg()[0], 2),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    md = args.out.with_suffix(".md")
    md.write_text(markdown(report))
    print(markdown(report))
    print(f"wrote {args.out} and {md}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
