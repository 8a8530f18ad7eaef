"""Recovery time after a server crash: SIGKILL the middle span's server during a greedy generation.

    python load_tests/bench_failover.py --kills 10 --out bench_results/failover.json

Swarm: blocks 0:1, 1:3, 3:4 of a tiny Llama plus a spare 1:3, all on this machine. Each round opens a
session, decodes ``--tokens`` greedy tokens and, at token ``--kill-at``, SIGKILLs the process group of the
server holding block 1 in the session's route (main process, hivemind's DHT process and p2pd: a machine
failure). The client fails over to the spare and replays the span's history; after the round a new spare is
started, so every kill finds one. Greedy tokens are checked against a run without faults.

recovery = (time the first token computed through the replacement is delivered) - (kill time)
           - (median normal step time)

Two kill modes, both measured by default:
- ``inflight``: the kill lands at a random moment, normally while a step is in flight (the realistic
  case). The victim never answers; the client notices through its liveness probe (``probe_after``: a
  step silent that long pings the server; a failed ping fails the step) or, failing that, ``--step-timeout``.
- ``between``: the kill lands between two steps (as in tests/test_failover.py): the next write fails at
  once, so this measures the failover machinery itself (ban, re-route, open, replay).

Writes JSON (``--out``) and Markdown (same name, ``.md``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from swarm_client import AutoDistributedModelForCausalLM  # noqa: E402
from tests.swarm_fixtures import Proc, Swarm  # noqa: E402

SPANS = ["0:1", "1:3", "3:4"]
MIDDLE = "1:3"


@dataclass
class Kill:
    mode: str
    round: int
    killed_peer: str
    kill_at_token: int
    normal_step_ms: float
    kill_to_replacement_token_ms: float
    recovery_ms: float
    failovers: int
    tokens_match: bool


@dataclass
class Round:
    tokens: list[int] = field(default_factory=list)
    #: (start, end, failovers so far) of every decode step; times from time.monotonic()
    steps: list[tuple[float, float, int]] = field(default_factory=list)
    killed_at: float | None = None
    killed_peer: str = ""
    failovers: int = 0


def worker_of(s: Swarm, peer_id: str) -> Proc:
    return next(w for w in s.workers if getattr(w, "peer_id", None) == peer_id)


def generate(model, prompt: torch.Tensor, tokens: int, on_step=None) -> Round:
    """Greedy decode in one session; ``on_step(step, session, round)`` runs before each decode step."""
    result = Round()
    with torch.inference_mode(), model.inference_session(max_length=prompt.shape[1] + tokens + 1) as session:
        logits = model(prompt, session=session).logits
        for step in range(tokens):
            token = logits[:, -1].argmax(-1, keepdim=True)
            result.tokens.append(int(token))
            if step + 1 == tokens:
                break
            if on_step is not None:
                on_step(step + 1, session, result)
            t0 = time.monotonic()
            logits = model(token, session=session).logits
            result.steps.append((t0, time.monotonic(), session.failovers))
        result.failovers = session.failovers
    return result


def run_round(s: Swarm, model, prompt, args, mode: str, index: int, reference: list[int]) -> Kill:
    rng = random.Random(index)

    def on_step(step: int, session, result: Round) -> None:
        if step != args.kill_at:
            return
        middle = next(h for h in session.route if h.start <= 1 < h.end)
        victim = worker_of(s, middle.peer_id)
        result.killed_peer = middle.peer_id
        if mode == "between":
            result.killed_at = time.monotonic()
            victim.kill()
            return
        normal = statistics.median(e - b for b, e, _ in result.steps[2:])

        def later() -> None:
            time.sleep(rng.uniform(0.0, 2 * normal))  # lands inside one of the next steps
            result.killed_at = time.monotonic()
            victim.kill()

        threading.Thread(target=later, daemon=True).start()

    result = generate(model, prompt, args.tokens, on_step)
    assert result.killed_at is not None, "the round ended before the kill"
    before = [e - b for b, e, _ in result.steps[2 : args.kill_at - 1]]
    normal = statistics.median(before)
    # the first token that went through the replacement (a step already answered by the victim before it
    # died can still land just after the kill: that one is no recovery)
    failovers_before = result.steps[args.kill_at - 2][2]
    recovered = min(e for _, e, failovers in result.steps if failovers > failovers_before)
    kill_to_next = recovered - result.killed_at
    return Kill(
        mode=mode,
        round=index,
        killed_peer=result.killed_peer,
        kill_at_token=args.kill_at,
        normal_step_ms=1000 * normal,
        kill_to_replacement_token_ms=1000 * kill_to_next,
        recovery_ms=1000 * max(0.0, kill_to_next - normal),
        failovers=result.failovers,
        tokens_match=result.tokens == reference,
    )


def summarize(kills: list[Kill]) -> dict:
    recoveries = [k.recovery_ms for k in kills]
    return {
        "kills": len(kills),
        "median_recovery_ms": statistics.median(recoveries),
        "max_recovery_ms": max(recoveries),
        "min_recovery_ms": min(recoveries),
        "median_normal_step_ms": statistics.median(k.normal_step_ms for k in kills),
        "all_tokens_match": all(k.tokens_match for k in kills),
        "per_kill": [asdict(k) for k in kills],
    }


def markdown(results: dict) -> str:
    head = (
        f"Model: {results['model']}, spans {results['spans']} + spare {MIDDLE}; {results['tokens']} greedy "
        f"tokens a round, kill at token {results['kill_at']}; step_timeout {results['step_timeout_s']} s, "
        f"liveness probe after {results.get('probe_after_s')} s of silence."
    )
    lines = [
        "# Failover recovery (SIGKILL of the middle span's server)",
        "",
        head,
        "recovery = first token through the replacement − kill time − median normal step.",
        "",
        "| mode | kills | median recovery (ms) | max (ms) | min (ms) | normal step (ms) | tokens equal |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, r in results["modes"].items():
        cells = [mode, r["kills"], *(f"{r[k]:.1f}" for k in ("median_recovery_ms", "max_recovery_ms"))]
        cells += [f"{r['min_recovery_ms']:.1f}", f"{r['median_normal_step_ms']:.2f}", r["all_tokens_match"]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    for mode, r in results["modes"].items():
        lines += [
            "",
            f"## {mode}",
            "",
            "| # | recovery (ms) | kill → token via replacement (ms) | failovers | equal |",
        ]
        lines.append("|---|---|---|---|---|")
        for k in r["per_kill"]:
            cells = [
                k["round"],
                f"{k['recovery_ms']:.1f}",
                f"{k['kill_to_replacement_token_ms']:.1f}",
                k["failovers"],
            ]
            lines.append("| " + " | ".join(str(c) for c in [*cells, k["tokens_match"]]) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=10, help="kills per mode")
    parser.add_argument("--modes", default="inflight,between", help="comma-separated: inflight, between")
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--kill-at", type=int, default=16)
    parser.add_argument("--step-timeout", type=float, default=30.0, help="client step_timeout (s)")
    parser.add_argument("--out", default="bench_results/failover.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]

    from swarm_client.tiny_model import make_tiny_model

    results: dict = {
        "model": "tiny llama (4 layers)",
        "spans": SPANS,
        "tokens": args.tokens,
        "kill_at": args.kill_at,
        "step_timeout_s": args.step_timeout,
        "modes": {},
    }
    with tempfile.TemporaryDirectory(prefix="bench-failover-") as tmp:
        model_path = str(make_tiny_model(Path(tmp) / "tiny-llama", family="llama", num_layers=4, seed=0))
        s = Swarm(model_path)
        try:
            for span in [*SPANS, MIDDLE]:
                s.add_worker("--throughput", "1000", blocks=span)
            model = AutoDistributedModelForCausalLM.from_pretrained(
                model_path,
                initial_peers=[s.initial_peers],
                update_period=0.5,
                step_timeout=args.step_timeout,
                failover_deadline=60,
            )
            results["probe_after_s"] = model.manager.config.probe_after
            prompt = torch.tensor([[3, 14, 15, 92, 65]])
            reference = generate(model, prompt, args.tokens).tokens
            for mode in modes:
                kills = []
                for i in range(args.kills):
                    kill = run_round(s, model, prompt, args, mode, i, reference)
                    kills.append(kill)
                    took, normal = kill.kill_to_replacement_token_ms, kill.normal_step_ms
                    print(
                        f"{mode} kill {i}: recovery {kill.recovery_ms:.1f} ms (kill → token via replacement "
                        f"{took:.1f} ms, normal step {normal:.2f} ms), tokens equal: {kill.tokens_match}",
                        flush=True,
                    )
                    s.add_worker("--throughput", "1000", blocks=MIDDLE)  # the next kill finds a spare again
                results["modes"][mode] = summarize(kills)
            model.shutdown()
        finally:
            s.close()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    out.with_suffix(".md").write_text(markdown(results))
    for mode, r in results["modes"].items():
        print(
            f"{mode}: median recovery {r['median_recovery_ms']:.1f} ms, max {r['max_recovery_ms']:.1f} ms "
            f"over {r['kills']} kills; greedy tokens equal: {r['all_tokens_match']}"
        )
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
