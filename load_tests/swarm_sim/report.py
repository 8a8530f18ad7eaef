"""The report: a Markdown table of each run's figures and an SVG chart of served throughput against the
hardware bound as the swarm grows (drawn by hand: matplotlib is not a dependency)."""

from __future__ import annotations

from collections.abc import Sequence

from load_tests.swarm_sim.run import Result

ROWS = (
    ("simulated minutes (after 1 min of joins)", "minutes", "{:g}"),
    ("served tokens/s (mean before the crash)", "served_tok_s", "{:,.0f}"),
    ("hardware bound tokens/s", "bound_tok_s", "{:,.0f}"),
    ("route latency / best, p50", "route_latency_ratio_p50", "{:.2f}"),
    ("route latency / best, p95", "route_latency_ratio_p95", "{:.2f}"),
    ("servers crashed by the hole", "crashed", "{:,.0f}"),
    ("blocks missing right after it", "max_missing_blocks", "{:,.0f}"),
    ("seconds to full coverage again", "recovered_after", "{}"),
    ("DHT writes / server / s", "dht_writes_per_server_s", "{:.2f}"),
    ("DHT records per route read (80 keys)", "dht_records_per_route_read", "{:,.0f}"),
    ("DHT kB per route read", "dht_kb_per_route_read", "{:,.0f}"),
    ("find_route CPU ms per call", "route_cpu_ms_per_call", "{:,.0f}"),
    ("sessions opened", "sessions", "{:,.0f}"),
    ("routes refused (NoRouteError)", "no_route", "{:,.0f}"),
    ("failovers (dead hop)", "failovers", "{:,.0f}"),
    ("busy refusals (full cache)", "busy_refusals", "{:,.0f}"),
    ("slow peers banned / kept", "slow", "{}"),
    ("rebalancing moves", "moves", "{:,.0f}"),
    ("simulator CPU s", "sim_cpu_s", "{:,.0f}"),
)


def _value(result: Result, key: str) -> str:
    fig = result.figures
    if key == "minutes":
        return f"{result.minutes:g}"
    if key == "crashed":
        return f"{result.crashed}"
    if key == "recovered_after":
        return "not within the run" if result.recovered_after is None else f"{result.recovered_after:.0f}"
    if key == "slow":
        return f"{fig['slow_bans']:.0f} / {fig['slow_kept']:.0f}"
    ratio = {"served_tok_s": f" ({fig['served_tok_s'] / max(fig['bound_tok_s'], 1e-9):.0%} of bound)"}
    text = dict((k, f) for _, k, f in ROWS)[key].format(fig[key])
    return text + ratio.get(key, "")


def markdown(results: Sequence[Result], command: str, svg_name: str, notes: str = "") -> str:
    head = "| | " + " | ".join(f"{r.servers} servers, {r.clients} clients" for r in results) + " |"
    lines = [
        "# Swarm simulator (issue 39)", "", f"Command: `{command}`", "",
        f"![served throughput vs hardware bound]({svg_name})", "", head,
        "|---" * (len(results) + 1) + "|",
    ]
    lines += ["| " + label + " | " + " | ".join(_value(r, key) for r in results) + " |" for label, key, _ in ROWS]
    return "\n".join(lines) + "\n\n" + notes


def svg(results: Sequence[Result], width: int = 520, height: int = 320) -> str:
    """Two polylines over log10(servers): served tokens/s and the hardware bound (log10 y)."""
    import math

    pad = 60
    xs = [math.log10(r.servers) for r in results]
    series = {"served": [r.figures["served_tok_s"] for r in results],
              "bound": [r.figures["bound_tok_s"] for r in results]}
    ys_all = [math.log10(max(v, 1.0)) for vals in series.values() for v in vals]
    x0, x1 = min(xs) - 0.2, max(xs) + 0.2
    y0, y1 = math.floor(min(ys_all)), math.ceil(max(ys_all))

    def px(x: float, y: float) -> str:
        sx = pad + (x - x0) / (x1 - x0) * (width - 2 * pad)
        sy = height - pad - (y - y0) / max(y1 - y0, 1e-9) * (height - 2 * pad)
        return f"{sx:.1f},{sy:.1f}"

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="12"><rect width="100%" height="100%" fill="white"/>',
           f'<text x="{width / 2}" y="20" text-anchor="middle">swarm throughput vs hardware bound (tokens/s)</text>',
           f'<polyline points="{px(x0, y0)} {px(x1, y0)}" stroke="black" fill="none"/>',
           f'<polyline points="{px(x0, y0)} {px(x0, y1)}" stroke="black" fill="none"/>']
    for r, x in zip(results, xs, strict=True):
        sx, sy = px(x, y0).split(",")
        out.append(f'<text x="{sx}" y="{float(sy) + 18}" text-anchor="middle">{r.servers} servers</text>')
    for y in range(y0, y1 + 1):
        sx, sy = px(x0, y).split(",")
        out.append(f'<text x="{float(sx) - 6}" y="{sy}" text-anchor="end">1e{y}</text>')
    for (name, vals), color in zip(series.items(), ("#1f77b4", "#d62728"), strict=True):
        points = " ".join(px(x, math.log10(max(v, 1.0))) for x, v in zip(xs, vals, strict=True))
        out.append(f'<polyline points="{points}" stroke="{color}" stroke-width="2" fill="none"/>')
        lx, ly = px(xs[-1], math.log10(max(vals[-1], 1.0))).split(",")
        out.append(f'<text x="{float(lx) + 6}" y="{ly}" fill="{color}">{name}</text>')
    return "\n".join(out) + "\n</svg>\n"
