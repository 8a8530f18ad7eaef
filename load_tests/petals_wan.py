"""Petals 2.2 on the emulated WAN of load_tests/bench_wan.py: per-token and first-token latency of a 3-server chain
(a DHT, three ``petals.cli.run_server`` of blocks 0:2, 2:4, 4:6 of the tiny random 6-layer Llama, one client), in
the same network lab (tests/netlab.py, root only), same hosts, addresses and one-way delays (``SCENARIOS``,
``HOSTS``, ``SPANS`` and ``floors`` are imported from bench_wan, so both always measure the same network).

Petals runs from its own venv (it pins transformers<4.35 and hivemind 1.1.10.post2); the lab, the delays and this
script run in the project's venv. Setting the Petals venv up offline (what worked on 2026-12-06, see the .md):

    python3.11 -m venv /work/petals-venv && P=/work/petals-venv/bin/pip
    $P install torch==2.1.2 "numpy<2" grpcio-tools "setuptools<70"
    # hivemind 1.1.10.post2 is an sdist whose build downloads p2pd from GitHub: build it with the p2pd binary
    # of the project's hivemind copied into hivemind/hivemind_cli/ and its sha256 put in setup.py
    $P wheel --no-build-isolation --no-deps -w wheels ./hivemind-1.1.10.post2
    $P install wheels/hivemind-1.1.10.post2-*.whl petals==2.2.0.post1 accelerate==0.25.0 multiaddr==0.0.9

Then:

    sudo .venv/bin/python -m load_tests.petals_wan [--scenarios a,b] [--s2s on,off] [--reps 3] [--new-tokens 32]
        [--petals-python /work/petals-venv/bin/python] [--out-prefix load_tests/results/petals-wan-2026-12-06]

The model: ``make_tiny_model`` saves with transformers 5 (llama3 rope scaling, which transformers 4.34 cannot
read); Petals gets a copy with the same safetensors weights and a 4.34 config (plain rope, theta 500000), so
its tokens are checked against transformers 4.34's local ``generate`` on that copy, not against bench_wan's.
Per scenario the DHT and servers start once, delays are set once they are up, one uncounted warm-up client
runs, then ``--reps`` clients per ``--s2s`` setting (Petals' ``use_server_to_server``, its server-to-server
push, default on). Each client process: ``from_pretrained``, the cold first token (a new inference session and
the 8-token prompt's prefill), ``--new-tokens`` greedy decode steps each timed (``model(token)`` in the
session: embeddings, ``session.step``, norm, LM head), then the warm first token of a second session.
Writes ``<prefix>.json`` (raw numbers) and ``<prefix>.md`` (tables).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from load_tests.bench_wan import HOSTS, PROMPTS, SCENARIOS, SERVERS, SPANS, floors, git, run_script
from swarm_client.tiny_model import make_tiny_model
from tests.netlab import NetLab, unavailable, unavailable_delays

PETALS_PYTHON = "/work/petals-venv/bin/python"
DHT_PORT, SERVER_PORT = 31337, 31330
PREFIX = "tinyllama-hf"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
       "MKL_NUM_THREADS": "1", "PETALS_IGNORE_DEPENDENCY_VERSION": "1", "PYTHONUNBUFFERED": "1"}  # fmt: skip
S2S = {"on": True, "off": False}
#: a Petals server, version check against PyPI skipped (no internet in the lab; it only logs a warning anyway)
SERVER = "import petals.cli.run_server as r; r.validate_version = lambda: None; r.main()"

#: one client process (Petals venv): from_pretrained, a cold and a warm session; one RESULT line
CLIENT = r"""
import json, os, sys, time, traceback
import torch
from petals import AutoDistributedModelForCausalLM
from transformers import LlamaForCausalLM
path, peer, prefix, s2s = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
prompt, n = json.loads(sys.argv[5]), int(sys.argv[6])
torch.set_num_threads(1)
result = {}

def stream(model):
    tokens, steps = [], []
    with torch.inference_mode(), model.inference_session(max_length=len(prompt) + n) as s:
        t0 = time.perf_counter()
        token = model(torch.tensor([prompt])).logits[:, -1].argmax(-1, keepdim=True)
        first = (time.perf_counter() - t0) * 1000
        tokens.append(int(token))
        for _ in range(n - 1):
            t0 = time.perf_counter()
            token = model(token).logits[:, -1].argmax(-1, keepdim=True)
            steps.append(round((time.perf_counter() - t0) * 1000, 2))
            tokens.append(int(token))
    return {"tokens": tokens, "step_ms": steps, "first_ms": round(first, 1)}

try:
    with torch.inference_mode():
        ref = LlamaForCausalLM.from_pretrained(path).generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    result["reference"] = ref[0, len(prompt):].tolist()
    t0 = time.monotonic()
    model = AutoDistributedModelForCausalLM.from_pretrained(path, initial_peers=[peer], dht_prefix=prefix,
                                                            torch_dtype=torch.float32, use_server_to_server=s2s)
    result["from_pretrained_ms"] = round((time.monotonic() - t0) * 1000, 1)
    result["use_server_to_server"] = model.config.use_server_to_server
    result["cold"] = stream(model)
    result["warm"] = stream(model)
except BaseException as exc:
    result["error"] = f"{type(exc).__name__}: {exc}"
    result["traceback"] = traceback.format_exc()[-3000:]
print("RESULT " + json.dumps(result), flush=True)
os._exit(0)
"""


def compatible_copy(model: Path, out: Path) -> Path:
    """The tiny model with a config transformers 4.34 (Petals 2.2) reads: same weights, plain rope."""
    config = json.loads((model / "config.json").read_text())
    keep = ("architectures", "attention_bias", "hidden_act", "hidden_size", "initializer_range", "intermediate_size",
            "max_position_embeddings", "model_type", "num_attention_heads", "num_hidden_layers",
            "num_key_value_heads", "pad_token_id", "rms_norm_eps", "tie_word_embeddings", "vocab_size")  # fmt: skip
    compat = {k: config[k] for k in keep if k in config}
    theta = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta", 10000.0))
    compat.update(rope_theta=theta, rope_scaling=None, bos_token_id=1, eos_token_id=2, torch_dtype="float32",
                  use_cache=True, pretraining_tp=1, transformers_version="4.34.1")  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(model / "model.safetensors", out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(compat, indent=2))
    return out


class Proc:
    """A Petals process in a lab namespace, its output in a log file."""

    def __init__(self, lab: NetLab, ns: str, name: str, argv: list[str], logdir: Path) -> None:
        self.name, self.log = name, logdir / f"{name}.log"
        with self.log.open("w") as out:
            self.popen = subprocess.Popen(lab.argv(ns, *argv), stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=ENV, start_new_session=True)  # fmt: skip

    def wait_for(self, text: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.log.read_text(errors="replace").splitlines():
                if text in line:
                    return line
            if self.popen.poll() is not None:
                break
            time.sleep(0.5)
        tail = self.log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{self.name}: no {text!r} within {timeout} s (exit {self.popen.poll()}):\n{tail}")

    def stop(self) -> None:
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            if self.popen.poll() is not None:
                return
            try:
                os.killpg(self.popen.pid, sig)  # its p2pd is in its process group
            except ProcessLookupError:
                return
            try:
                self.popen.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass


def run_client(lab: NetLab, ns: str, args: argparse.Namespace, client_args: list[str]) -> dict:
    return run_script(lab, ns, [args.petals_python, "-c", CLIENT, *client_args], 600, ENV)


def derive(run: dict) -> dict:
    if "error" in run:
        return {"ok": False}
    ref, cold, warm = run["reference"], run["cold"], run["warm"]
    steps = cold["step_ms"]
    return {"ok": cold["tokens"] == ref and warm["tokens"] == ref,
            "ms_per_token_median": round(statistics.median(steps), 2),
            "ms_per_token_p90": round(statistics.quantiles(steps, n=10, method="inclusive")[8], 2),
            "warm_ms_per_token_median": round(statistics.median(warm["step_ms"]), 2),
            "from_pretrained_ms": run["from_pretrained_ms"], "cold_first_ms": cold["first_ms"],
            "warm_first_ms": warm["first_ms"]}  # fmt: skip


KEYS = ("ms_per_token_median", "ms_per_token_p90", "warm_ms_per_token_median", "from_pretrained_ms", "cold_first_ms",
        "warm_first_ms")  # fmt: skip


def medians(runs: list[dict]) -> dict:
    ok = [r["derived"] for r in runs if "error" not in r]
    summary: dict[str, Any] = {k: round(statistics.median(d[k] for d in ok), 2) for k in KEYS} if ok else {}
    summary.update(runs=len(runs), failed=len(runs) - len(ok), token_mismatch_runs=sum(not d["ok"] for d in ok))
    return summary


def run_scenario(name: str, model: Path, args: argparse.Namespace, logdir: Path) -> dict:
    hosts, pairs = SCENARIOS[name]
    delays = {"by_host": hosts, "by_pair": {f"{a}->{b}": ms for (a, b), ms in pairs.items()}}
    out: dict[str, Any] = {"delays_ms": delays, "floor_ms": floors(name), "runs": {s: [] for s in args.s2s}}
    procs: list[Proc] = []
    with NetLab() as lab:
        try:
            ns = {h: lab.host(h, ip) for h, ip in HOSTS.items()}
            here = f"/ip4/{HOSTS['dht']}/tcp/{DHT_PORT}"
            argv = [args.petals_python, "-m", "petals.cli.run_dht", "--host_maddrs", here, "--announce_maddrs", here]
            procs.append(dht := Proc(lab, ns["dht"], f"{name}-dht", argv, logdir))
            maddr = dht.wait_for(f"--initial_peers {here}/p2p/", 120).split("--initial_peers ", 1)[1].split()[0]
            for s in SERVERS:
                here = f"/ip4/{HOSTS[s]}/tcp/{SERVER_PORT}"
                argv = [args.petals_python, "-c", SERVER, str(model), "--initial_peers", maddr, "--block_indices",
                        SPANS[s], "--host_maddrs", here, "--announce_maddrs", here, "--dht_prefix", PREFIX,
                        "--torch_dtype", "float32", "--device", "cpu", "--num_handlers", "1", "--throughput", "1",
                        "--skip_reachability_check", "--inference_max_length", "512"]  # fmt: skip
                procs.append(Proc(lab, ns[s], f"{name}-{s}", argv, logdir))
            for p in procs[1:]:
                p.wait_for("[INFO] Started", 300)
            lab.delay(hosts)
            for (source, destination), ms in pairs.items():
                lab.delay_between(source, destination, ms)
            time.sleep(2)

            def client(s2s: str) -> dict:
                t0 = time.monotonic()
                run = run_client(lab, ns["client"], args, [str(model), maddr, PREFIX, "1" if S2S[s2s] else "0",
                                                           json.dumps(PROMPTS[0]), str(args.new_tokens)])  # fmt: skip
                run["derived"], run["wall_s"] = derive(run), round(time.monotonic() - t0, 1)
                return run

            out["warmup"] = client(args.s2s[0])  # not counted: the servers' first steps are slow on any network
            for rep in range(args.reps):
                for s2s in args.s2s:
                    run = client(s2s)
                    out["runs"][s2s].append(run)
                    d = run["derived"]
                    status = "ok" if d["ok"] else run.get("error", "TOKEN MISMATCH")
                    print(f"[{name} s2s={s2s} rep {rep + 1}/{args.reps}] {run['wall_s']} s, {status}: "
                          f"{d.get('ms_per_token_median')} ms/token, cold first {d.get('cold_first_ms')} ms, "
                          f"warm first {d.get('warm_first_ms')} ms", flush=True)  # fmt: skip
                    if "error" in run:
                        print(run.get("traceback") or run.get("output_tail", ""), flush=True)
        finally:
            for p in reversed(procs):
                p.stop()
    out["medians"] = {s: medians(out["runs"][s]) for s in args.s2s}
    return out


def markdown(report: dict) -> str:
    meta = report["meta"]
    head = ("scenario", "Petals server-to-server", "floor ms/token: push chain", "floor: no push (3 client RTTs)",
            "measured ms/token (median)", "p90", "warm session ms/token", "first token cold ms",
            "first token warm ms", "from_pretrained ms", "runs / failed / token mismatches")  # fmt: skip
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, sc in report["scenarios"].items():
        f = sc["floor_ms"]
        for s2s, m in sc["medians"].items():
            counts = f"{m['runs']} / {m['failed']} / {m['token_mismatch_runs']}"
            if not m.get("ms_per_token_median"):
                rows.append(f"| {name} | {s2s} | {f['on']:.0f} | {f['off']:.0f} | failed | | | | | | {counts} |")
                continue
            rows.append(f"| {name} | {s2s} | {f['on']:.0f} | {f['off']:.0f} | {m['ms_per_token_median']:.1f} | "
                        f"{m['ms_per_token_p90']:.1f} | {m['warm_ms_per_token_median']:.1f} | "
                        f"{m['cold_first_ms']:.0f} | {m['warm_first_ms']:.0f} | {m['from_pretrained_ms']:.0f} | "
                        f"{counts} |")  # fmt: skip
    intro = (
        f"`{meta['command']}` at `{meta['git_head'][:12]}` ({meta['machine']}; {meta['versions']}). "
        f"Medians of {meta['reps']} client runs, {meta['new_tokens']} greedy tokens after an 8-token prompt, "
        "each decode step timed in the client (embeddings + Petals `session.step` + norm + LM head); "
        "first token = a new inference session's prompt prefill. Floors per token from bench_wan's "
        "`floors`: push chain = client→s1 + s1→s2 + s2→s3 + s3→client, no push = Σ client↔server RTT."
    )
    title = f"# Petals 2.2 on the emulated WAN, {meta['date']}: 3 servers × 2 blocks of a tiny 6-layer Llama"
    return "\n".join([title, "", intro, "", *rows, ""])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default="a,b", help=f"comma-separated, of {','.join(SCENARIOS)}")
    parser.add_argument("--s2s", default="on,off", help="Petals use_server_to_server settings: on,off")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--petals-python", default=PETALS_PYTHON)
    parser.add_argument("--out-prefix", default="load_tests/results/petals-wan-2026-12-06")
    args = parser.parse_args()
    scenarios = [s for s in args.scenarios.split(",") if s]
    args.s2s = [s for s in args.s2s.split(",") if s]
    if bad := [s for s in scenarios if s not in SCENARIOS] + [s for s in args.s2s if s not in S2S]:
        parser.error(f"unknown scenario or --s2s setting: {bad}")
    if args.new_tokens < 3 or args.reps < 1:
        parser.error("--new-tokens must be at least 3, --reps at least 1")
    if reason := unavailable() or unavailable_delays():
        print(f"petals_wan: the network lab cannot run here: {reason}", file=sys.stderr)
        return 2
    probe = "import petals, hivemind, transformers, torch; print(petals.__version__, hivemind.__version__, " \
            "transformers.__version__, torch.__version__)"  # fmt: skip
    try:
        found = subprocess.run([args.petals_python, "-c", probe], capture_output=True, text=True, env=ENV, timeout=300)
    except OSError as exc:
        print(f"petals_wan: no Petals python ({exc}); see the docstring", file=sys.stderr)
        return 2
    if found.returncode:
        print(f"petals_wan: Petals does not import:\n{found.stderr[-2000:]}", file=sys.stderr)
        return 2
    versions = "petals {}, hivemind {}, transformers {}, torch {}".format(*found.stdout.split()[-4:])
    work = Path(tempfile.mkdtemp(prefix="petals-wan-"))
    model = compatible_copy(make_tiny_model(work / "tiny-llama", family="llama", num_layers=6, seed=0),
                            work / "tiny-llama-t434")  # fmt: skip
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "versions": versions,
            "command": f"python -m load_tests.petals_wan {' '.join(sys.argv[1:])}".strip(),
            "git_head": git("rev-parse", "HEAD").strip(), "logs": str(work),
            "machine": f"{os.cpu_count()} cores, {platform.machine()}, CPU only, OMP_NUM_THREADS=1",
            "reps": args.reps, "new_tokens": args.new_tokens, "prompt": PROMPTS[0]}  # fmt: skip
    report: dict[str, Any] = {"meta": meta, "scenarios": {}}
    started = time.monotonic()
    for name in scenarios:
        report["scenarios"][name] = run_scenario(name, model, args, work)
    meta["total_s"] = round(time.monotonic() - started, 1)
    prefix = Path(args.out_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    prefix.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    bad = [(n, s) for n, sc in report["scenarios"].items() for s, m in sc["medians"].items()
           if m["failed"] or m["token_mismatch_runs"]]  # fmt: skip
    if bad:
        print(f"!!! FAILED RUNS OR TOKEN MISMATCHES in {bad}: see {prefix.with_suffix('.json')}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
