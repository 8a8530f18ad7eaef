"""CPU projection kernels for small batches: plain torch, oneDNN-packed, and our panel kernel.

    python load_tests/bench_kernels.py                          # the medium model's 4-layer span
    python load_tests/bench_kernels.py --rows 1,2,4,8,16,32,128 --layers 4 --out bench_results/kernels.json

Times the seven projections of ``--layers`` Llama layers shaped like the medium model (hidden 1024,
intermediate 2816, 16 query / 4 KV heads: ≈178 MB of float32 weights for 4 layers, far more than the L3
cache, as on a server) for each row count, on one thread. The kernels are measured *interleaved* (each
repetition runs every kernel once per row count), so a noisy machine slows them alike; the median of the
repetitions is reported, with each kernel's cost relative to its own single row (what continuous batching
lives on) and the panel kernel's speed-up over the others. Also checks that the panel kernel agrees with
``F.linear`` (max abs difference) and that its rows are batch-invariant. Writes JSON and a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from swarm_client.kernels import cpu_gemm  # noqa: E402
from swarm_client.kernels.cpu_kernels import PackedLinear, PanelLinear, packing_supported  # noqa: E402

#: (out_features, in_features) of q, k, v, o, gate, up, down in the medium model
MEDIUM_SHAPES = [(1024, 1024), (256, 1024), (256, 1024), (1024, 1024), (2816, 1024), (2816, 1024), (1024, 2816)]


def build(layers: int) -> dict[str, list[nn.Module]]:
    torch.manual_seed(0)
    linears = [nn.Linear(i, o, bias=False) for _ in range(layers) for o, i in MEDIUM_SHAPES]
    kernels: dict[str, list[nn.Module]] = {"torch": linears}
    if packing_supported(torch.device("cpu"), torch.float32):
        kernels["onednn"] = [PackedLinear(m) for m in linears]
    if cpu_gemm.load() is not None:
        kernels["panels"] = [PanelLinear(m) for m in linears]
    else:
        print(f"panel kernel unavailable: {cpu_gemm.load_error()}", file=sys.stderr)
    return kernels


def time_once(modules: list[nn.Module], inputs: dict[int, torch.Tensor]) -> float:
    t0 = time.perf_counter()
    for m in modules:
        m(inputs[m.in_features])
    return time.perf_counter() - t0


def check(kernels: dict[str, list[nn.Module]]) -> dict:
    x = torch.randn(9, 1024)
    plain, panel = kernels["torch"][4], kernels.get("panels", [None] * 5)[4]
    if panel is None:
        return {}
    full = panel(x)
    invariant = all(torch.equal(panel(x[i : i + 1]), full[i : i + 1]) for i in range(9))
    return {"max_abs_diff_vs_linear": float((full - plain(x)).abs().max()), "batch_invariant": invariant}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,2,4,8,16,32", help="row counts (decode steps batched together)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--out", type=Path, default=ROOT / "bench_results" / "kernels.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = [int(r) for r in args.rows.split(",")]
    with torch.inference_mode():
        kernels = build(args.layers)
        inputs = {m: {1024: torch.randn(m, 1024), 2816: torch.randn(m, 2816)} for m in rows}
        samples: dict[tuple[str, int], list[float]] = {(k, m): [] for k in kernels for m in rows}
        for rep in range(args.reps + 2):
            for m in rows:
                for name, modules in kernels.items():
                    seconds = time_once(modules, inputs[m])
                    if rep >= 2:  # the first two repetitions warm caches and allocators
                        samples[(name, m)].append(seconds)
        checks = check(kernels)
    ms = {k: {m: 1000 * statistics.median(samples[(k, m)]) for m in rows} for k in kernels}
    report = {
        "layers": args.layers,
        "weights_mb": round(sum(o * i for o, i in MEDIUM_SHAPES) * args.layers * 4 / 1e6, 1),
        "reps": args.reps,
        "ms": ms,
        "relative_to_one_row": {k: {m: v[m] / v[rows[0]] for m in rows} for k, v in ms.items()},
        "checks": checks,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    names = list(kernels)
    lines = [
        f"{args.layers} medium layers' projections ({report['weights_mb']} MB float32), one thread, "
        f"median of {args.reps} interleaved repetitions (ms; in brackets: cost relative to one row)",
        "",
        "| rows | " + " | ".join(names) + (" | panels speed-up |" if "panels" in ms else " |"),
        "|---:|" + "---:|" * len(names) + ("---:|" if "panels" in ms else ""),
    ]
    for m in rows:
        cells = [f"{ms[k][m]:.1f} ({ms[k][m] / ms[k][rows[0]]:.2f}×)" for k in names]
        if "panels" in ms:
            others = [k for k in names if k != "panels"]
            cells.append(", ".join(f"{ms[k][m] / ms['panels'][m]:.2f}× vs {k}" for k in others))
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    if checks:
        lines += ["", f"panel kernel vs F.linear: max |diff| {checks['max_abs_diff_vs_linear']:.2e}; "
                  f"rows batch-invariant: {checks['batch_invariant']}"]  # fmt: skip
    text = "\n".join(lines) + "\n"
    args.out.with_suffix(".md").write_text(text)
    print(text)
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
