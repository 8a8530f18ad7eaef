"""The gateway's OpenAPI schema fuzzed at scale: ``--examples`` (default 500) examples per operation and
mode, against a real uvicorn gateway (``LocalBackend`` over a random tiny Llama). Valid requests for every
operation in the schema, schema-violating bodies for every POST; the answer must never be a 5xx.

    python load_tests/schemathesis_500.py [--examples 500] [--out load_tests/results/schemathesis-DATE.json]

``tests/test_gateway_schemathesis.py`` is the CI-sized run of the same (20 examples); this one is too slow
for CI. Completion budgets and ``n`` are clamped as there, so a fuzzed ``max_tokens: 10**9`` costs a 400 or
a short generation. Unlike the test it does not stop at the first failure: every 5xx is recorded (status,
body, a curl command that repeats it) and the run goes on. Writes the count of examples and of answers by
status code per operation to ``--out``; exits 1 if any answer was a 5xx.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import schemathesis  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402

from gateway import BackgroundServer, GatewaySettings, LocalBackend, create_app  # noqa: E402
from swarm_client.tiny_model import make_tiny_model  # noqa: E402

MAX_TOKENS, MAX_N = 16, 2
TIMEOUT_S = 60.0


def _clamp(body: Any) -> None:
    if not isinstance(body, dict):
        return
    for key, cap in (
        ("max_tokens", MAX_TOKENS),
        ("max_completion_tokens", MAX_TOKENS),
        ("max_output_tokens", MAX_TOKENS),
        ("n", MAX_N),
    ):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[key] = cap


def fuzz(
    schema: Any,
    method: str,
    path: str,
    mode: str,
    examples: int,
    observe: Callable[[Any, Any], None] | None = None,
    prepare: Callable[[Any], None] | None = None,
) -> dict[str, Any]:
    """``examples`` cases of one operation; ``prepare(body)`` may edit each body before it is sent (after the
    budgets are clamped), ``observe(case, response)`` sees each answer."""
    operation = schema[path][method]
    statuses: Counter[int] = Counter()
    failures: list[dict[str, Any]] = []

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=GenerationMode(mode)))
    def run(case: Any) -> None:
        _clamp(case.body)
        if prepare is not None:
            prepare(case.body)
        response = case.call(timeout=TIMEOUT_S)
        statuses[response.status_code] += 1
        if observe is not None:
            observe(case, response)
        if response.status_code >= 500 and len(failures) < 20:
            failures.append(
                {"status": response.status_code, "body": response.text[:2000], "curl": case.as_curl_command()}
            )

    started = time.monotonic()
    run()
    return {
        "operation": f"{method} {path}",
        "mode": mode,
        "examples": sum(statuses.values()),
        "seconds": round(time.monotonic() - started, 1),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "server_errors": sum(v for k, v in statuses.items() if k >= 500),
        "failures": failures,
    }


@contextmanager
def served_gateway(tpm: int = 0) -> Iterator[str]:
    """A real uvicorn gateway over a random tiny Llama (``LocalBackend``); yields its base URL."""
    with tempfile.TemporaryDirectory(prefix="fuzz-") as tmp:
        model = make_tiny_model(Path(tmp) / "tiny-llama", family="llama", num_layers=4, seed=0)
        backend = LocalBackend(model)
        server = BackgroundServer(
            create_app(backend, GatewaySettings(default_max_tokens=32, rate_limit_tpm=tpm))
        ).start()
        try:
            yield server.url
        finally:
            server.stop()
            backend.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=500)
    parser.add_argument("--only", default="", help="fuzz only operations whose path contains this")
    parser.add_argument("--tpm", type=int, default=0, help="a per-key token limit: the rate limiter counts too")
    parser.add_argument("--out", type=Path, default=ROOT / "bench_results" / "schemathesis.json")
    args = parser.parse_args()

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.ERROR)  # a 500's traceback still shows; "unknown fields" lines do not
    with served_gateway(args.tpm) as url:
        schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
        operations = [(op.method.upper(), op.path) for op in (r.ok() for r in schema.get_all_operations())]
        runs = [(m, p, "positive") for m, p in operations]
        runs += [(m, p, "negative") for m, p in operations if m == "POST"]
        results = []
        for method, path, mode in runs:
            if args.only and args.only not in path:
                continue
            result = fuzz(schema, method, path, mode, args.examples)
            print(json.dumps({k: v for k, v in result.items() if k != "failures"}), flush=True)
            for failure in result["failures"]:
                print("  5xx:", failure["curl"], "->", failure["body"][:300], flush=True)
            results.append(result)
    summary = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "schemathesis": schemathesis.__version__,
        "max_examples_per_operation_and_mode": args.examples,
        "rate_limit_tpm": args.tpm,
        "operations": len({r["operation"] for r in results}),
        "runs": len(results),
        "examples": sum(r["examples"] for r in results),
        "server_errors": sum(r["server_errors"] for r in results),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"{summary['examples']} examples over {summary['operations']} operations: {summary['server_errors']} 5xx")
    print(f"wrote {args.out}")
    sys.exit(1 if summary["server_errors"] else 0)


if __name__ == "__main__":
    main()
