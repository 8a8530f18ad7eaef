"""A long Open WebUI chat through the defaults, on a replica of a real model's config: per turn the chat's
status, prompt and cached tokens and first-token time, its background requests' statuses, and — once the
conversation no longer fits — what the user is told (issue 40).

    python load_tests/bench_long_chat.py [--like llama-3.1-8b] [--turns 20] [--tools 36]
                                         [--cache-tokens auto] [--out bench_results/long_chat.json]

Builds ``swarmserve tiny-model --like`` (the published config, shrunk in size only: the 131k context stays),
starts a DHT and two workers with default flags but ``--cache-tokens`` (``auto`` is the default: sized from
free memory), a gateway with default settings (tests/gateway_fixtures.py ``swarm_gateway``, with the
gateway's own ``default_max_tokens`` of 512 rather than the tests' 32: the random model never stops, so
every reply is as long as the default lets it be), and replays the
conversation of tests/test_open_webui_cache.py — Open WebUI's recorded chat request with ``--tools`` of its
36 tools, then its follow-up, title and tags requests — for ``--turns`` turns, each turn asking one more
question. A turn that is refused ends the run with the refusal's message.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from gateway.settings import GatewaySettings  # noqa: E402
from swarm_client.model_likes import make_like_model  # noqa: E402
from tests.gateway_fixtures import swarm_gateway  # noqa: E402
from tests.swarm_fixtures import swarm  # noqa: E402
from tests.test_open_webui_cache import TASKS, chat_body, preamble_tokens, stream_chat, task_request  # noqa: E402

QUESTIONS = [
    "What time is it in Lisbon?", "And how long until midnight there?", "Which knowledge bases do I have?",
    "Search them for opening hours.", "Ask me which one I meant.", "Thanks, write it down.",
    "What was the first thing I asked?", "Summarize our chat so far.", "Translate that into Portuguese.",
    "Now make it shorter.", "Which tools can you use?", "Pick one and explain it.", "Give me an example call.",
    "What would it return?", "Is that always the case?", "What could go wrong?", "How would I notice?",
    "Write a checklist.", "Number the items.", "Thanks, that is all.",
]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--like", default="llama-3.1-8b")
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--tools", type=int, default=36)
    ap.add_argument("--cache-tokens", default="auto")
    default_max_tokens = GatewaySettings.model_fields["default_max_tokens"].default
    ap.add_argument("--default-max-tokens", type=int, default=default_max_tokens)
    ap.add_argument("--out", default=str(ROOT / "bench_results" / "long_chat.json"))
    args = ap.parse_args()
    model = str(Path(tempfile.mkdtemp(prefix="long-chat-")) / args.like)
    make_like_model(model, args.like)
    rows: list[dict] = []
    with (
        swarm(model, ["0:2", "2:4"], "--cache-tokens", args.cache_tokens, timeout=600) as s,
        swarm_gateway(model, s.initial_peers, default_max_tokens=args.default_max_tokens) as gw,
        httpx.Client(base_url=gw.url, timeout=900) as http,
    ):
        tools = slice(args.tools)
        preamble = preamble_tokens(gw, tools)
        messages: list[dict] = []
        for turn, question in enumerate((QUESTIONS * 4)[: args.turns], 1):
            messages.append({"role": "user", "content": question})
            reply = stream_chat(gw, chat_body(gw, messages, tools), timeout=900, refusals=True)
            tasks = {}
            if "error" not in reply:
                messages.append({"role": "assistant", "content": reply["text"]})
                for task in TASKS:
                    answer = http.post("/v1/chat/completions", json=task_request(gw.model, task, messages))
                    tasks[task] = answer.status_code
            row = {"turn": turn, **{k: v for k, v in reply.items() if k != "text"}, "tasks": tasks}
            rows.append(row)
            usage = reply.get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            ttft = f"{reply['ttft']:.2f} s" if reply.get("ttft") is not None else "-"
            print(f"turn {turn:2}: {reply['status']} prompt {usage.get('prompt_tokens')} cached {cached} "
                  f"first token {ttft} tasks {tasks}", flush=True)  # fmt: skip
            if "error" in reply:
                print(f"  refused: {reply['error']}")
                break
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"like": args.like, "tools": args.tools, "cache_tokens": args.cache_tokens, "preamble": preamble,
              "default_max_tokens": args.default_max_tokens}  # fmt: skip
    out.write_text(json.dumps({**result, "rows": rows}, indent=1))
    print(f"tool preamble {preamble} tokens; wrote {out}")


if __name__ == "__main__":
    main()
