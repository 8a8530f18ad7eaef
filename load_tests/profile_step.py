"""Where the time of one decode step goes: client head, serialization, transport, server compute, glue.

    python load_tests/profile_step.py --model tiny      # hidden 64, 4 layers
    python load_tests/profile_step.py --model medium    # hidden 1024, 8 layers, random weights

Measures, in one run and one process tree: the local 🤗 model per token; the same blocks computed
in-process (the server's compute floor); the client's embedding + final norm + LM head; tensor
(de)serialization; a raw hivemind streaming echo between two p2p daemons (the transport floor); and a
real step through one worker process (with the worker's own compute time from its info RPC).
Writes JSON to --out and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import AsyncIterator  # noqa: UP035 - hivemind needs typing.AsyncIterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from hivemind.p2p import P2P, P2PContext, ServicerBase  # noqa: E402
from hivemind.proto import runtime_pb2  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from load_tests.bench_decode import resolve_model, time_local  # noqa: E402
from swarm_client import AutoDistributedModelForCausalLM, protocol, runtime  # noqa: E402
from swarm_client.families import get_family  # noqa: E402
from tests.swarm_fixtures import swarm  # noqa: E402
from worker.cache import CacheManager  # noqa: E402
from worker.compute import SpanRunner  # noqa: E402


def median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


class Echo(ServicerBase):
    async def rpc_echo(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async for request in requests:
            yield runtime_pb2.ExpertResponse(tensors=request.tensors, metadata=request.metadata)


async def transport_floor(hidden: torch.Tensor, repeat: int) -> float:
    """Median round trip of one hidden-state message over a hivemind stream between two daemons."""
    server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    client = await P2P.create(initial_peers=await server.get_visible_maddrs())
    await Echo().add_p2p_handlers(server)
    queue: asyncio.Queue = asyncio.Queue()

    async def requests():
        while (item := await queue.get()) is not None:
            yield item

    stub = Echo.get_stub(client, server.peer_id)
    responses = await stub.rpc_echo(requests())
    times = []
    for _ in range(repeat + 10):
        t0 = time.perf_counter()
        queue.put_nowait(protocol.make_request([hidden], position=0))
        response = await anext(responses)
        protocol.deserialize(response.tensors[0])
        times.append(time.perf_counter() - t0)
    queue.put_nowait(None)
    await client.shutdown()
    await server.shutdown()
    return 1000 * statistics.median(times[10:])


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results: dict = {"model": args.model}
    with tempfile.TemporaryDirectory(prefix="profile-step-") as tmp, torch.inference_mode():
        path = resolve_model(args.model, Path(tmp))
        config = AutoConfig.from_pretrained(path)
        local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        prompt = torch.randint(0, config.vocab_size, (1, 16))
        time_local(local, prompt, 5)
        results["local_model_ms"] = 1000 * statistics.median(time_local(local, prompt, args.steps))

        family = get_family(config)
        state = local.state_dict()
        blocks = []
        for i in range(config.num_hidden_layers):
            prefix = family.layer_prefix(i)
            tensors = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
            blocks.append(family.build_block(config, i, tensors))
        runner = SpanRunner(blocks, torch.float32, torch.device("cpu"))
        caches = CacheManager(args.steps + 64, len(blocks), family.cache_layout(config), torch.float32)
        cache = caches.open("p", 1, args.steps + 40)
        caches.ensure_capacity(cache, args.steps + 40)
        x = torch.randn(1, 1, config.hidden_size)
        runner.inference_step(cache, torch.randn(1, 16, config.hidden_size), 0)
        results["blocks_in_process_ms"] = median_ms(
            lambda: runner.inference_step(cache, x, cache.position), args.steps
        )

        head = family.build_head(
            config,
            {k: v for k, v in state.items() if any(k.startswith(p) for p in family.head_prefixes(config))},
        )
        token = torch.tensor([[5]])
        results["client_head_ms"] = median_ms(lambda: head.final(head.embed(token)), args.steps)
        results["serialize_roundtrip_ms"] = median_ms(
            lambda: protocol.deserialize(protocol.make_request([x]).tensors[0]), args.steps
        )
        results["transport_floor_ms"] = runtime.run(transport_floor(x, args.steps))

        with swarm(path, [f"0:{config.num_hidden_layers}"]) as s:
            model = AutoDistributedModelForCausalLM.from_pretrained(path, initial_peers=[s.initial_peers])
            with model.inference_session(max_length=args.steps + 64) as session:
                model(prompt, session=session)
                for _ in range(10):
                    model(token, session=session)
                results["end_to_end_step_ms"] = median_ms(lambda: model(token, session=session), args.steps)
                info = runtime.run(model.manager.info(s.workers[0].peer_id))
            results["server_compute_ms"] = info.get("compute_ms_median")
            model.shutdown()

    known = results["server_compute_ms"] + results["client_head_ms"] + results["transport_floor_ms"]
    results["python_glue_ms"] = results["end_to_end_step_ms"] - known
    results["overhead_vs_local_ms"] = results["end_to_end_step_ms"] - results["local_model_ms"]
    rows = [
        ("local 🤗 model, per token", "local_model_ms"),
        ("blocks in-process (server compute floor)", "blocks_in_process_ms"),
        ("client embed + norm + LM head", "client_head_ms"),
        ("serialize + deserialize one hidden state", "serialize_roundtrip_ms"),
        ("raw hivemind stream round trip (transport floor)", "transport_floor_ms"),
        ("server compute inside the worker", "server_compute_ms"),
        ("end-to-end step through 1 worker", "end_to_end_step_ms"),
        ("unexplained: Python glue, queues, thread hops", "python_glue_ms"),
        ("overhead vs local per token", "overhead_vs_local_ms"),
    ]
    print(f"| {args.model} | ms |\n|---|---|")
    for label, key in rows:
        print(f"| {label} | {results[key]:.3f} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
