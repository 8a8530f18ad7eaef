"""What the gateway costs per token: the same greedy decode (a) straight through ``swarm_client`` and (b)
through ``swarmserve gateway``'s SSE stream, same model, same swarm, same number of tokens.

    python load_tests/bench_gateway.py --model PATH [--workers 1] [--tokens 64] [--repeats 3]
    python load_tests/bench_gateway.py --model PATH --initial-peers MADDR   # an existing swarm

Without ``--initial-peers`` it starts a DHT in this process and ``--workers`` block servers (the helpers of
``swarmserve up``). The gateway runs as its own process (``swarmserve gateway``), as users deploy it, and
is read with httpx. (a) is a loop of ``embed → InferenceSession.step → final → argmax``: exactly the
swarm work (b) needs per token, so (b) − (a) is the gateway's own cost: sampling, detokenization, SSE,
HTTP, thread hops. EOS is banned in (b) with ``logit_bias`` so both produce exactly ``--tokens`` tokens.

Writes JSON to ``--out`` (default ``bench_results/gateway.json``) and a Markdown table next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


from swarm_client.config import default_dht_prefix  # noqa: E402
from swarm_client.model_source import resolve_model_path  # noqa: E402
from swarmserve.launcher import ChildProcess, LocalSwarm  # noqa: E402

PROMPT = "The swarm of servers shares the layers of one model, so"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stats_ms(values_s: list[float]) -> dict[str, float]:
    ms = sorted(v * 1000 for v in values_s)
    return {
        "mean_ms": round(statistics.fmean(ms), 3),
        "median_ms": round(statistics.median(ms), 3),
        "p90_ms": round(ms[min(len(ms) - 1, int(0.9 * len(ms)))], 3),
        "count": len(ms),
    }


# ---------------------------------------------------------------------------------------------- the swarm
# ---------------------------------------------------------------------------------------------- (a) direct
def bench_direct(model: Any, prompt_ids: list[int], tokens: int) -> dict[str, Any]:
    """Greedy decode over an InferenceSession; per-token time of every step after the prefill."""
    head = model.head
    step_times: list[float] = []
    cpu0 = time.process_time()
    with torch.inference_mode():
        t0 = time.perf_counter()
        with model.blocks.inference_session(max_length=len(prompt_ids) + tokens) as session:
            hidden = session.step(head.embed(torch.tensor([prompt_ids])).float())  # [1, T, H]
            token = int(head.final(hidden[:, -1:])[0, -1].argmax())
            ttft = time.perf_counter() - t0
            generated = [token]
            for _ in range(tokens - 1):
                t = time.perf_counter()
                hidden = session.step(head.embed(torch.tensor([[token]])).float())  # [1, 1, H]
                token = int(head.final(hidden)[0, -1].argmax())
                step_times.append(time.perf_counter() - t)
                generated.append(token)
        total = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    return {"ttft_s": ttft, "total_s": total, "step_times": step_times, "tokens": generated, "cpu_s": cpu}


# ---------------------------------------------------------------------------------------------- (b) gateway
def start_gateway(model: str, maddrs: list[str], dht_prefix: str) -> tuple[ChildProcess, str]:
    """``swarmserve gateway`` as a child process (its CPU time is measured alone); its base URL."""
    port = _free_port()
    args = ["--log-level", "WARNING", "gateway", "--model", model, "--initial-peers", *maddrs,
            "--dht-prefix", dht_prefix, "--port", str(port)]  # fmt: skip
    gateway = ChildProcess.spawn("gateway", args)
    try:
        gateway.wait_for("swarmserve gateway ready:", timeout=300)
    except BaseException:
        gateway.stop()
        raise
    return gateway, f"http://127.0.0.1:{port}"


def bench_gateway(
    http: httpx.Client,
    gateway: psutil.Process,
    model: str,
    prompt_ids: list[int],
    tokens: int,
    eos: list[int],
) -> dict:
    """One streamed greedy completion; arrival time of every SSE chunk that carries text, and the CPU time
    the gateway process spent on it (unlike wall time, hardly changed by other load on the machine)."""
    body = {
        "model": model,
        "prompt": prompt_ids,
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logit_bias": {str(t): -100 for t in eos},
    }
    arrivals: list[float] = []
    usage = None
    cpu0 = sum(gateway.cpu_times()[:2])
    t0 = time.perf_counter()
    with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"gateway answered {response.status_code}: {response.read().decode()[:500]}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            if any(c.get("text") for c in chunk.get("choices", [])):
                arrivals.append(time.perf_counter())
    total = time.perf_counter() - t0
    cpu = sum(gateway.cpu_times()[:2]) - cpu0
    n = int(usage["completion_tokens"]) if usage else len(arrivals)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    per_token = (arrivals[-1] - arrivals[0]) / max(1, n - 1) if len(arrivals) > 1 else float("nan")
    return {
        "ttft_s": arrivals[0] - t0 if arrivals else float("nan"),
        "total_s": total,
        "gaps": gaps,
        "per_token_s": per_token,
        "completion_tokens": n,
        "chunks": len(arrivals),
        "cpu_s": cpu,
    }


# ---------------------------------------------------------------------------------------------- report
def markdown(report: dict) -> str:
    d, g = report["direct"], report["gateway"]
    dp, gi = d["per_token"], g["inter_chunk"]
    rows = [
        "| path | per-token mean (ms) | median (ms) | p90 (ms) | tok/s | TTFT (ms) | CPU ms/token |",
        "|---|---|---|---|---|---|---|",
        f"| swarm_client InferenceSession (direct) | {dp['mean_ms']} | {dp['median_ms']} | {dp['p90_ms']} "
        f"| {d['tokens_per_s']} | {d['ttft_ms']} | {d['client_cpu_ms_per_token']} |",
        f"| gateway SSE (`/v1/completions`, httpx) | {g['per_token_mean_ms']} | {gi['median_ms']} "
        f"| {gi['p90_ms']} | {g['tokens_per_s']} | {g['ttft_ms']} | {g['gateway_cpu_ms_per_token']} |",
    ]
    machine = report["machine"]
    return (
        f"# Gateway overhead — {report['model']}\n\n"
        f"{report['num_blocks']} blocks on {report['workers']} worker(s); {report['tokens']} tokens × "
        f"{report['repeats']} repeats, greedy, prompt {report['prompt_tokens']} tokens; "
        f"{machine['cpus']} CPUs (load average {machine['load_average_1m_at_end']}), "
        f"torch {machine['torch']}.\n\n"
        + "\n".join(rows)
        + f"\n\n**Gateway overhead: {report['overhead_ms_per_token']} ms per token** "
        f"({report['overhead_pct']}% of the direct per-token time); "
        f"TTFT overhead {report['ttft_overhead_ms']} ms; CPU overhead "
        f"{report['cpu_overhead_ms_per_token']} ms per token.\n\n"
        "Gateway median/p90 are inter-chunk gaps (a chunk may carry more than one token when the "
        "detokenizer holds an incomplete character); its mean is (last chunk − first chunk) / (tokens − 1). "
        "CPU ms/token: CPU time of the process doing the head's work (the bench process for the direct "
        "loop, the gateway process for SSE) per generated token — a figure other load hardly moves.\n"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="local model directory (or an id swarm_client resolves)")
    p.add_argument("--initial-peers", nargs="*", default=None, help="use this swarm instead of starting one")
    p.add_argument("--dht-prefix", default=None)
    p.add_argument("--workers", type=int, default=1, help="block servers to start (without --initial-peers)")
    p.add_argument("--torch-threads", type=int, default=None, help="threads per worker")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="bench_results/gateway.json")
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    from swarm_client import AutoDistributedModelForCausalLM

    model_dir = resolve_model_path(args.model)
    prefix = args.dht_prefix or default_dht_prefix(args.model)
    own = (
        None
        if args.initial_peers
        else LocalSwarm.covering(
            model_dir,
            args.workers,
            timeout=600,
            dht_prefix=default_dht_prefix(args.model),
            threads=args.torch_threads,
            say=print,
        )
    )
    maddrs = args.initial_peers or own.maddrs  # type: ignore[union-attr]
    gateway = None
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        prompt_ids = list(tokenizer(PROMPT)["input_ids"])
        model = AutoDistributedModelForCausalLM.from_pretrained(
            str(model_dir), maddrs, dht_prefix=prefix, dht=own.dht if own else None
        )
        eos_ids = [*_as_list(model.generation_config.eos_token_id), tokenizer.eos_token_id]
        eos = sorted({int(t) for t in eos_ids if t is not None})
        gateway, gateway_url = start_gateway(args.model, maddrs, prefix)
        direct_runs, gateway_runs = [], []
        with httpx.Client(base_url=gateway_url, timeout=600) as http:
            bench_direct(model, prompt_ids, 4)  # warm-up: routes, connections, allocator
            gw_proc = psutil.Process(gateway.popen.pid)
            bench_gateway(http, gw_proc, args.model, prompt_ids, 4, eos)
            for i in range(args.repeats):  # interleaved, so drift hits both paths alike
                direct_runs.append(bench_direct(model, prompt_ids, args.tokens))
                gateway_runs.append(bench_gateway(http, gw_proc, args.model, prompt_ids, args.tokens, eos))
                d, g = direct_runs[-1], gateway_runs[-1]
                direct_ms = statistics.fmean(d["step_times"]) * 1000
                print(
                    f"repeat {i + 1}/{args.repeats}: direct {direct_ms:.2f} ms/token, gateway "
                    f"{g['per_token_s'] * 1000:.2f} ms/token "
                    f"({g['completion_tokens']} tokens, {g['chunks']} chunks)",
                    flush=True,
                )
        num_blocks = int(model.config.num_hidden_layers)
        model.shutdown()
    finally:
        if gateway is not None:
            gateway.stop(timeout=30)
        if own is not None:
            own.close()

    direct_steps = [t for r in direct_runs for t in r["step_times"]]
    direct_stats = _stats_ms(direct_steps)
    gw_per_token_ms = statistics.fmean(r["per_token_s"] for r in gateway_runs) * 1000
    direct_ttft_ms = statistics.median(r["ttft_s"] for r in direct_runs) * 1000
    gw_ttft_ms = statistics.median(r["ttft_s"] for r in gateway_runs) * 1000
    overhead = gw_per_token_ms - direct_stats["mean_ms"]
    direct_cpu_ms = statistics.fmean(r["cpu_s"] / args.tokens for r in direct_runs) * 1000
    gateway_cpu_ms = statistics.fmean(r["cpu_s"] / r["completion_tokens"] for r in gateway_runs) * 1000
    report = {
        "benchmark": "gateway_overhead",
        "model": args.model,
        "num_blocks": num_blocks,
        "workers": len(own.workers) if own else None,
        "initial_peers": None if own else maddrs,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "prompt_tokens": len(prompt_ids),
        "direct": {
            "per_token": direct_stats,
            "tokens_per_s": round(1000 / direct_stats["mean_ms"], 2),
            "ttft_ms": round(direct_ttft_ms, 2),
            "client_cpu_ms_per_token": round(direct_cpu_ms, 3),
        },
        "gateway": {
            "per_token_mean_ms": round(gw_per_token_ms, 3),
            "inter_chunk": _stats_ms([gap for r in gateway_runs for gap in r["gaps"]]),
            "tokens_per_s": round(1000 / gw_per_token_ms, 2),
            "ttft_ms": round(gw_ttft_ms, 2),
            "completion_tokens": [r["completion_tokens"] for r in gateway_runs],
            "chunks": [r["chunks"] for r in gateway_runs],
            "gateway_cpu_ms_per_token": round(gateway_cpu_ms, 3),
        },
        "overhead_ms_per_token": round(overhead, 3),
        "overhead_pct": round(100 * overhead / direct_stats["mean_ms"], 1),
        "ttft_overhead_ms": round(gw_ttft_ms - direct_ttft_ms, 2),
        # CPU the gateway process burns per token beyond what the bare client loop burns
        "cpu_overhead_ms_per_token": round(gateway_cpu_ms - direct_cpu_ms, 3),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "platform": platform.platform(),
            # other processes compete for the CPUs on a shared machine: read the figures against this
            "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        },
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    md = markdown(report)
    out.with_suffix(".md").write_text(md)
    print(md)
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


def _as_list(value: Any) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


if __name__ == "__main__":
    sys.exit(main())
