"""``python -m load_tests.swarm_sim --servers 100,1000,5000 --clients 400,200,40 --minutes 3,1.5,0.5 --seed 0``:
run one scenario per swarm size, write ``load_tests/results/swarm-sim-<date>.md`` and ``.svg``."""

from __future__ import annotations

import argparse
import datetime
import pathlib
import sys

from load_tests.swarm_sim.report import markdown, svg
from load_tests.swarm_sim.run import simulate

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "results"


def _list(text: str, kind: type) -> list:
    return [kind(part) for part in text.split(",") if part]


def main(argv: list[str] | None = None) -> pathlib.Path:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--servers", default="100,1000,5000", help="swarm sizes, comma-separated")
    parser.add_argument("--clients", default="400,200,40", help="clients per size (one value: all sizes)")
    parser.add_argument("--minutes", default="3,1.5,0.5", help="simulated minutes per size (one value: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args(argv)
    sizes = _list(args.servers, int)
    clients = _list(args.clients, int) * (len(sizes) if "," not in args.clients else 1)
    minutes = _list(args.minutes, float) * (len(sizes) if "," not in args.minutes else 1)
    results = []
    for n, c, m in zip(sizes, clients, minutes, strict=True):
        print(f"simulating {n} servers, {c} clients, {m:g} min ...", file=sys.stderr, flush=True)
        results.append(simulate(n, c, m, seed=args.seed))
    stem = f"swarm-sim-{datetime.date.today().isoformat()}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.svg").write_text(svg(results))
    command = "python -m load_tests.swarm_sim " + " ".join(sys.argv[1:] if argv is None else argv)
    (args.out / f"{stem}.md").write_text(markdown(results, command, f"{stem}.svg"))
    return args.out / f"{stem}.md"


if __name__ == "__main__":
    print(main())
