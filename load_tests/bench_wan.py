"""Emulated-WAN benchmark: per-token latency, first-token time and 4-stream throughput of a 3-server chain with
one-way delays on the links, with server-to-server push off, on, and at the client's default, next to the
network floor those delays impose.

The lab (tests/netlab.py, root only) puts a DHT, three workers (blocks 0:2, 2:4, 4:6 of a tiny random 6-layer
Llama) and a client host in network namespaces; delays are user-space NFQUEUE holds (tests/netlab_delay.py),
set once the workers are up. Scenarios: ``a`` every host waits 25 ms on everything it sends; ``b`` the client
is 40 ms one way from every server and from the DHT (both directions), servers and DHT 2 ms apart; ``c0`` no
delay (baseline, no delay processes). The DHT and workers start once per scenario (then one uncounted warm-up
run); each run is a brand-new client process in the client host that measures

1. ``from_pretrained``, then the cold first token (from ``from_pretrained`` returning: routing, pings, opening
   the streams, the prefill of an 8-token prompt), then ``--new-tokens`` greedy tokens, timing each decode
   step (``model(token, session=s)``: embeddings, ``session.step``, final norm, LM head);
2. the warm first token: a second session on the same client right after, and its decode steps;
3. ``--streams`` concurrent streams (threads, one session each, one prompt each) on the same client: decode
   tokens of all streams / wall time from the last prefill to the last token.

Every stream's tokens are checked against the local 🤗 model's greedy ``generate`` (a mismatch is printed and
makes the exit code 1). Floors per token: push off, the sum over the servers of the client<->server RTT; push
on, client->first server + the server->server hops + last server->client (one way each); "default" (the
client's own choice, ``push="auto"``) is held to the push-on floor where the servers used pushed steps.

    sudo .venv/bin/python -m load_tests.bench_wan [--scenarios a,b] [--push off,on,default] [--reps 3]
        [--new-tokens 32] [--out-prefix load_tests/results/wan-2026-12-06]

Writes ``<prefix>.json`` (all raw numbers, medians), ``<prefix>.md`` (tables), ``<prefix>.png`` (matplotlib).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

# the lab is wan_lab's; its names stay importable from here (petals_wan, bench_speculation)
from load_tests.wan_lab import ENV, HOSTS, PORT, SCENARIOS, SERVERS, SPANS, start_lab_swarm  # noqa: F401
from swarm_client.sequence_manager import ClientConfig
from swarm_client.tiny_model import make_tiny_model
from tests.netlab import NetLab, unavailable, unavailable_delays

PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79], [2, 71, 82, 81, 82, 84, 59, 4],
           [1, 41, 42, 13, 56, 23, 73, 9], [16, 18, 3, 39, 88, 74, 98, 94]]  # fmt: skip
SUMMARY_KEYS = ("ms_per_token_median", "ms_per_token_p90", "warm_ms_per_token_median", "from_pretrained_ms",
                "cold_first_ms", "warm_first_ms", "aggregate_tok_s", "single_tok_s", "x_single",
                "pushes_used")  # fmt: skip
COLUMNS = ("scenario", "push", "floor ms/token", "measured ms/token (median)", "ratio", "p90",
           "first token cold ms (RTTs)", "first token warm ms (RTTs)", "4-stream aggregate tok/s",
           "× single")  # fmt: skip
PUSH = {"off": {"push": False}, "on": {"push": True}, "default": {}}

#: one client process: from_pretrained, a cold and a warm stream, N concurrent streams; one RESULT line
CLIENT = r"""
import contextlib, json, os, sys, threading, time, traceback
import torch
from swarm_client import AutoDistributedModelForCausalLM, runtime
path, peer, options, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
n, streams = int(sys.argv[5]), int(sys.argv[6])
result = {}

def stream(model, prompt, marks, barrier=None):
    tokens, steps = [], []
    with torch.inference_mode(), model.inference_session(max_length=len(prompt) + n) as s:
        token = model(torch.tensor([prompt]), session=s).logits[:, -1].argmax(-1, keepdim=True)
        marks["first"] = time.monotonic()
        tokens.append(int(token))
        if barrier is not None:
            barrier.wait(timeout=300)
        marks["decode_start"] = time.monotonic()
        for _ in range(n - 1):
            t0 = time.perf_counter()
            token = model(token, session=s).logits[:, -1].argmax(-1, keepdim=True)
            steps.append(round((time.perf_counter() - t0) * 1000, 2))
            tokens.append(int(token))
        marks["end"] = time.monotonic()
        return {"tokens": tokens, "step_ms": steps, "route": [h.peer_id for h in s.route],
                "pushing": getattr(s, "pushing", None)}

try:
    t0 = time.monotonic()
    model = AutoDistributedModelForCausalLM.from_pretrained(path, initial_peers=[peer], **options)
    ready = time.monotonic()
    result["from_pretrained_ms"] = round((ready - t0) * 1000, 1)
    result["push_config"] = repr(model.manager.config.push)
    result["cold"] = stream(model, prompts[0], marks := {})
    result["cold_first_ms"] = round((marks["first"] - ready) * 1000, 1)
    t1 = time.monotonic()
    result["warm"] = stream(model, prompts[0], marks := {})
    result["warm_first_ms"] = round((marks["first"] - t1) * 1000, 1)
    barrier, outs, all_marks = threading.Barrier(streams), [None] * streams, [{} for _ in range(streams)]

    def work(i):
        try:
            outs[i] = stream(model, prompts[i % len(prompts)], all_marks[i], barrier)
        except BaseException as exc:
            outs[i] = {"error": f"{type(exc).__name__}: {exc}"}
            barrier.abort()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(streams)]
    [t.start() for t in threads] and [t.join() for t in threads]
    if errors := [o["error"] for o in outs if "error" in o]: raise RuntimeError(f"concurrent streams failed: {errors}")
    decode_s = max(m["end"] for m in all_marks) - min(m["decode_start"] for m in all_marks)
    result["concurrent"] = {"streams": outs, "decode_s": round(decode_s, 4), "decode_tokens": streams * (n - 1)}
    route = result["cold"]["route"]
    info = {p: runtime.run(model.manager.info(p), timeout=30) for p in route}
    result["counters"] = {p: {k: i.get(k, 0) for k in ("pushes_sent", "pushes_used")} for p, i in info.items()}
except BaseException as exc:
    result["error"] = f"{type(exc).__name__}: {exc}"
    result["traceback"] = traceback.format_exc()[-3000:]
print("RESULT " + json.dumps(result), flush=True)
with contextlib.suppress(BaseException):
    model.shutdown()  # its p2p daemon goes with it
os._exit(0)
"""


def one_way(scenario: str, source: str, destination: str) -> float:
    hosts, pairs = SCENARIOS[scenario]
    return pairs.get((source, destination), hosts.get(source, 0.0))


def floors(scenario: str) -> dict[str, float]:
    """Network floor per token (ms) with push off and on, and the mean client<->server RTT."""
    rtts = [one_way(scenario, "client", s) + one_way(scenario, s, "client") for s in SERVERS]
    chain = sum(one_way(scenario, a, b) for a, b in zip(SERVERS, SERVERS[1:], strict=False))
    on = one_way(scenario, "client", SERVERS[0]) + chain + one_way(scenario, SERVERS[-1], "client")
    return {"off": sum(rtts), "on": on, "rtt": statistics.mean(rtts)}


def default_push_supported() -> tuple[bool, str]:
    """Whether the installed client takes ``push="auto"`` and defaults to it: only then is "default" a third
    setting (a client whose ``push`` is a plain bool, default False, took any value unchecked)."""
    default = {f.name: f.default for f in dataclasses.fields(ClientConfig)}.get("push")
    try:
        ClientConfig(initial_peers=[], dht_prefix="x", num_blocks=1, push="auto")  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        return False, f"push='auto' refused: {exc}"
    return default == "auto", f"ClientConfig.push defaults to {default!r}"


def references(model: str, new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    local = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        return [
            local.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False)[0, len(p) :].tolist()
            for p in PROMPTS
        ]


def run_script(lab: NetLab, ns: str, command: list[str], timeout: float, env: dict) -> dict:
    """``command`` in ``ns``; its last ``RESULT <json>`` line, or an error with the output's tail (output to a
    file: a client's p2p daemon may outlive it, and a pipe would not end)."""
    with tempfile.TemporaryFile("w+") as out:
        try:
            argv = lab.argv(ns, *command)
            done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, text=True, timeout=timeout, env=env)
            rc: int | str = done.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        out.seek(0)
        text = out.read()
    lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
    if not lines:
        return {"error": f"no RESULT line (exit {rc})", "output_tail": text[-3000:]}
    return json.loads(lines[-1].removeprefix("RESULT "))


def derive(run: dict, refs: list[list[int]], before: dict[str, dict]) -> dict:
    """Per-run figures and the token check (a reference cut short by EOS is compared on its length)."""
    if "error" in run:
        return {"ok": False}
    streams = [run["cold"], run["warm"], *run["concurrent"]["streams"]]
    expected = [refs[p % len(refs)] for p in [0, 0, *range(len(streams) - 2)]]
    mismatches = [i for i, (s, ref) in enumerate(zip(streams, expected, strict=True)) if s["tokens"][: len(ref)] != ref]
    steps, warm = run["cold"]["step_ms"], run["warm"]["step_ms"]
    median, p90 = statistics.median(steps), statistics.quantiles(steps, n=10, method="inclusive")[8]
    used = sum(c["pushes_used"] - before.get(p, {}).get("pushes_used", 0) for p, c in run["counters"].items())
    aggregate = run["concurrent"]["decode_tokens"] / run["concurrent"]["decode_s"]
    return {"ok": not mismatches, "token_mismatch_streams": mismatches, "ms_per_token_median": round(median, 2),
            "ms_per_token_p90": round(p90, 2), "warm_ms_per_token_median": round(statistics.median(warm), 2),
            "from_pretrained_ms": run["from_pretrained_ms"], "cold_first_ms": run["cold_first_ms"],
            "warm_first_ms": run["warm_first_ms"], "aggregate_tok_s": round(aggregate, 2),
            "single_tok_s": round(1000 / median, 2), "x_single": round(aggregate * median / 1000, 2),
            "pushes_used": used}  # fmt: skip


def run_scenario(name: str, model: str, settings: list[str], args: argparse.Namespace, refs: list) -> dict:
    hosts, pairs = SCENARIOS[name]
    delays = {"by_host": hosts, "by_pair": {f"{a}->{b}": ms for (a, b), ms in pairs.items()}}
    out: dict[str, Any] = {"delays_ms": delays, "floor_ms": floors(name), "runs": {s: [] for s in settings}}
    with NetLab() as lab:
        ns, maddr, dht, workers = start_lab_swarm(lab, model, name)
        out["peers"] = {w.name: w.peer_id for w in workers}
        time.sleep(2)
        client_args = [json.dumps(PROMPTS), str(args.new_tokens), str(args.streams)]
        # one run first, not counted: the workers' first steps (allocations, lazy init) are slow on any network
        client = [sys.executable, "-c", CLIENT, model, maddr]
        out["warmup"] = run_script(lab, ns["client"], [*client, json.dumps(PUSH["off"]), *client_args], 600, ENV)
        counters: dict[str, dict] = out["warmup"].get("counters", {})
        for rep in range(args.reps):
            for setting in settings:
                t0 = time.monotonic()
                run = run_script(lab, ns["client"], [*client, json.dumps(PUSH[setting]), *client_args], 600, ENV)
                run["derived"] = derive(run, refs, counters)
                run["wall_s"] = round(time.monotonic() - t0, 1)
                counters = run.get("counters", counters)
                out["runs"][setting].append(run)
                d = run["derived"]
                status = "ok" if d["ok"] else run.get("error", "TOKEN MISMATCH")
                print(f"[{name} push={setting} rep {rep + 1}/{args.reps}] {run['wall_s']} s, {status}: "
                      f"{d.get('ms_per_token_median')} ms/token, cold {d.get('cold_first_ms')} ms, warm "
                      f"{d.get('warm_first_ms')} ms, {d.get('aggregate_tok_s')} tok/s x{args.streams}, "
                      f"pushes used {d.get('pushes_used')}", flush=True)  # fmt: skip
                if "error" in run:
                    print(run.get("traceback") or run.get("output_tail", ""), flush=True)
        for w in (*workers, dht):
            w.stop(timeout=10)
    out["medians"] = {s: medians(out["runs"][s]) for s in settings}
    return out


def medians(runs: list[dict]) -> dict:
    ok = [r["derived"] for r in runs if "error" not in r]
    summary: dict[str, Any] = {k: round(statistics.median(d[k] for d in ok), 2) for k in SUMMARY_KEYS} if ok else {}
    summary.update(runs=len(runs), failed=len(runs) - len(ok), token_mismatch_runs=sum(not d["ok"] for d in ok))
    return summary


def floor_key(setting: str, summary: dict) -> str:
    """Which floor applies: "default" is judged by what the servers did (pushed copies used, or none)."""
    if setting == "default":
        return "on" if summary.get("pushes_used") else "off"
    return setting


def quanta(runs: list[dict], one_way_ms: float) -> str:
    """Decode steps (cold and warm streams) by how many client one-way delays they took over the fastest one."""
    steps = [x for r in runs if "error" not in r for x in r["cold"]["step_ms"] + r["warm"]["step_ms"]]
    if not steps or not one_way_ms:
        return "-"
    counts = Counter(min(3, round((x - min(steps)) / one_way_ms)) for x in steps)
    return " / ".join(f"{100 * counts[k] / len(steps):.0f}%" for k in range(4))


def rtts(ms: float, rtt: float) -> str:
    return f"{ms:.0f} ({ms / rtt:.1f})" if rtt else f"{ms:.0f} (-)"


def markdown(report: dict) -> str:
    head = COLUMNS
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes = []
    for name, sc in report["scenarios"].items():
        for setting, m in sc["medians"].items():
            if not m.get("ms_per_token_median"):
                rows.append(f"| {name} | {setting} | " + " | ".join(["failed"] * (len(head) - 2)) + " |")
                continue
            floor, rtt = sc["floor_ms"][floor_key(setting, m)], sc["floor_ms"]["rtt"]
            ratio = f"{m['ms_per_token_median'] / floor:.2f}" if floor else "-"
            rows.append(
                f"| {name} | {setting} | {floor:.0f} | {m['ms_per_token_median']:.1f} | {ratio} | "
                f"{m['ms_per_token_p90']:.1f} | {rtts(m['cold_first_ms'], rtt)} | "
                f"{rtts(m['warm_first_ms'], rtt)} | {m['aggregate_tok_s']:.1f} | {m['x_single']:.2f} |"
            )
            push = sc["runs"][setting][0].get("push_config")
            notes.append(
                f"| {name} | {setting} | {push} | {m['pushes_used']:.0f} | {m['from_pretrained_ms']:.0f} | "
                f"{quanta(sc['runs'][setting], rtt / 2)} | {m['runs']} | {m['failed']} | {m['token_mismatch_runs']} |"
            )
    meta = report["meta"]
    intro = (f"`{meta['command']}` at `{meta['git_head'][:12]}` plus a working tree with {len(meta['git_status'])} "
             f"paths changed or new (the JSON's meta.git_status) ({meta['machine']}). Medians of {meta['reps']} "
             f"runs, {meta['new_tokens']} new tokens after an 8-token prompt; floor: push off = Σ client↔server "
             "RTT, push on = client→s1 + s1→s2 + s2→s3 + s3→client; RTTs = client↔server round trips. "
             f"{meta['default_push']}.")  # fmt: skip
    extra = ("| scenario | push | client's push setting | pushes used by servers per run | from_pretrained ms | "
             "decode steps at fastest / +1 / +2 / +3+ client one-way delays | runs | failed | token mismatches |"
             "\n|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    title = f"# Emulated WAN, {meta['date']}: 3 servers × 2 blocks of a tiny 6-layer Llama"
    return "\n".join([title, "", intro, "", *rows, "", extra, *notes, ""])


def plot(report: dict, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): no plot"
    labels, measured, floor = [], [], []
    for name, sc in report["scenarios"].items():
        for setting, m in sc["medians"].items():
            if m.get("ms_per_token_median"):
                labels.append(f"{name}\npush {setting}")
                measured.append(m["ms_per_token_median"])
                floor.append(sc["floor_ms"][floor_key(setting, m)])
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(labels)), 4.5))
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], measured, 0.4, label="measured ms/token (median)")
    ax.bar([i + 0.2 for i in x], floor, 0.4, label="network floor ms/token", color="lightgray", edgecolor="gray")
    ax.set_xticks(list(x), labels)
    ax.set(ylabel="ms per token", title="Emulated WAN: decode ms/token vs the network floor (3 servers)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return f"wrote {path}"


def git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).parents[1]).stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default="a,b", help=f"comma-separated, of {','.join(SCENARIOS)}")
    parser.add_argument("--push", default="off,on,default", help="comma-separated, of off,on,default")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--out-prefix", default="load_tests/results/wan-2026-12-06")
    args = parser.parse_args()
    scenarios = [s for s in args.scenarios.split(",") if s]
    settings = [s for s in args.push.split(",") if s]
    if bad := [s for s in scenarios if s not in SCENARIOS] + [s for s in settings if s not in PUSH]:
        parser.error(f"unknown scenario or push setting: {bad}")
    if args.new_tokens < 3 or args.reps < 1 or args.streams < 1:
        parser.error("--new-tokens must be at least 3 (two decode steps), --reps and --streams at least 1")
    if reason := unavailable() or unavailable_delays():
        print(f"bench_wan: the network lab cannot run here: {reason}", file=sys.stderr)
        return 2
    supported, why = default_push_supported()
    if "default" in settings and not supported:
        print(f"push 'default' skipped: the installed client has no push='auto' ({why})", flush=True)
        settings.remove("default")
    model = str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny-llama", family="llama", num_layers=6, seed=0))
    refs = references(model, args.new_tokens)
    command = f"python -m load_tests.bench_wan {' '.join(sys.argv[1:])}".strip()
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "command": command,
            "git_head": git("rev-parse", "HEAD").strip(), "git_status": git("status", "--short").splitlines(),
            "machine": f"{os.cpu_count()} cores, {platform.machine()}, CPU only, workers --torch-threads 1",
            "reps": args.reps, "new_tokens": args.new_tokens, "streams": args.streams, "prompts": PROMPTS,
            "reference_tokens": refs, "default_push": why, "push_settings": settings}  # fmt: skip
    report: dict[str, Any] = {"meta": meta, "scenarios": {}}
    started = time.monotonic()
    for name in scenarios:
        report["scenarios"][name] = run_scenario(name, model, settings, args, refs)
    report["meta"]["total_s"] = round(time.monotonic() - started, 1)
    prefix = Path(args.out_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    prefix.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    print(plot(report, prefix.with_suffix(".png")))
    summaries = [(n, s, m) for n, sc in report["scenarios"].items() for s, m in sc["medians"].items()]
    mismatched = [(n, s) for n, s, m in summaries if m["token_mismatch_runs"] or m["failed"]]
    if mismatched:
        print(f"!!! TOKEN MISMATCHES OR FAILED RUNS in {mismatched}: see {prefix.with_suffix('.json')}", flush=True)
    return 1 if mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
