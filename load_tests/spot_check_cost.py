"""What spot checks cost: greedy tokens/s with ``spot_check_rate`` 0 vs the default, over one real swarm.

    python load_tests/spot_check_cost.py --rounds 12 --tokens 64 \\
        --out load_tests/results/spot-check-cost-2026-12-06.json

Swarm: a tiny Llama (4 layers) served by two workers per span (0:2, 0:2, 2:4, 2:4; ``--throughput 1000`` so
routing is deterministic), all on this machine, one torch thread per process. One client per rate, each
with its own DHT client; rounds interleave the rates (order alternating) so a load change on the machine
hits both alike. Each round is one session: a prefill of ``--prompt`` tokens and ``--tokens`` greedy decode
steps; tokens/s counts the decoded tokens over the session's wall time. A spot check re-runs one hop's
step on the other server of its span as a stateless forward over the hop's whole input history, so its
cost grows with the position; the greedy tokens of every run are checked equal.

Writes JSON (``--out``): per rate the median and every round's tokens/s and the spot checks run, and
``ratio`` = median tokens/s at the default rate / median at rate 0, and ``paired_ratio_median``, the median
of the rounds' own ratios (the two runs of a round ran back to back).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from swarm_client import AutoDistributedModelForCausalLM  # noqa: E402
from swarm_client.sequence_manager import DEFAULT_SPOT_CHECK_RATE  # noqa: E402
from tests.swarm_fixtures import Swarm, greedy_session  # noqa: E402

SPANS = ["0:2", "0:2", "2:4", "2:4"]


def generate(model, prompt: torch.Tensor, tokens: int) -> tuple[list[int], float, int]:
    """Greedy decode in one session: (tokens, seconds, spot checks run)."""
    t0 = time.perf_counter()
    out, session = greedy_session(model, prompt, tokens)
    return out, time.perf_counter() - t0, session.spot_checks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12, help="sessions per rate")
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per session")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    parser.add_argument("--rate", type=float, default=DEFAULT_SPOT_CHECK_RATE, help="the rate compared with 0")
    parser.add_argument("--out", default="load_tests/results/spot-check-cost.json")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from swarm_client.tiny_model import make_tiny_model

    rates = [0.0, args.rate]
    results: dict = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "model": "tiny llama (4 layers, hidden 64)",
        "spans": SPANS,
        "prompt_tokens": args.prompt,
        "new_tokens": args.tokens,
        "rounds": args.rounds,
        "rates": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        model_path = str(make_tiny_model(Path(tmp) / "tiny-llama", family="llama", num_layers=4, seed=0))
        swarm = Swarm(model_path)
        models = {}
        try:
            for span in SPANS:
                swarm.add_worker("--throughput", "1000", blocks=span)
            for rate in rates:
                models[rate] = AutoDistributedModelForCausalLM.from_pretrained(
                    model_path, initial_peers=[swarm.initial_peers], spot_check_rate=rate
                )
            prompt = torch.randint(3, 200, (1, args.prompt), generator=torch.Generator().manual_seed(0))
            reference = None
            runs: dict[float, list[float]] = {rate: [] for rate in rates}
            checks: dict[float, int] = dict.fromkeys(rates, 0)
            for rate in rates:  # warm-up: routes, RTTs, first connections
                generate(models[rate], prompt, 4)
            for round_ in range(args.rounds):
                for rate in rates if round_ % 2 == 0 else rates[::-1]:
                    tokens, seconds, spot_checks = generate(models[rate], prompt, args.tokens)
                    reference = reference or tokens
                    if tokens != reference:
                        raise AssertionError(f"greedy tokens differ at rate {rate}")
                    runs[rate].append(args.tokens / seconds)
                    checks[rate] += spot_checks
                    print(f"round {round_} rate {rate}: {args.tokens / seconds:.1f} tok/s, {spot_checks} checks")
            hop_steps = args.rounds * args.tokens * 2  # two hops per step (0:2, 2:4)
            for rate in rates:
                results["rates"][str(rate)] = {
                    "median_tokens_per_s": round(statistics.median(runs[rate]), 2),
                    "tokens_per_s": [round(x, 2) for x in runs[rate]],
                    "spot_checks": checks[rate],
                    "hop_steps": hop_steps,
                }
            results["default_rate"] = args.rate
            results["ratio"] = round(statistics.median(runs[args.rate]) / statistics.median(runs[0.0]), 4)
            # each round's two runs ran back to back: their ratio cancels slow drifts of the machine's load
            paired = [a / b for a, b in zip(runs[args.rate], runs[0.0], strict=True)]
            results["paired_ratio_median"] = round(statistics.median(paired), 4)
            results["tokens_match"] = True
        finally:
            for model in models.values():
                model.shutdown()
            swarm.close()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: v for k, v in results.items() if k != "rates"}, indent=2))
    for rate, row in results["rates"].items():
        print(f"rate {rate}: median {row['median_tokens_per_s']} tok/s, {row['spot_checks']} spot checks")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
