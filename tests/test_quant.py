"""Quantized servers (worker/quant.py, swarm_client/kernels/quant_gemm.py): formats, kernel, blocks, auto choice,
display;
and real workers started with ``--quant int8`` (announced, routed or avoided by ``min_precision``, batched
steps equal to unbatched ones)."""

from __future__ import annotations

import asyncio
import json
import subprocess

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig

from swarm_client.dht_records import ServerInfo, ServerState
from swarm_client.families import get_family
from swarm_client.kernels import quant_gemm
from swarm_client.kernels.quantized import Int8Linear, NF4Linear
from swarmserve.processes import child_env, swarmserve_argv
from worker.cache import CacheManager
from worker.compute import SpanRunner, StepItem
from worker.loading import load_blocks
from worker.quant import (
    BYTES_PER_PARAM,
    QUANT_CHOICES,
    QuantizationUnavailable,
    choose_quant,
    quantize_linears_cuda,
    resolve_quant,
)

CPU = torch.device("cpu")
needs_kernel = pytest.mark.skipif(quant_gemm.load() is None, reason=f"no quantized kernel: {quant_gemm.load_error()}")


def weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


# ---------------------------------------------------------------- formats
def test_int8_error_is_at_most_half_a_step_per_channel():
    w = weight(37, 100)
    w[3] = 0  # an all-zero row stays exactly zero
    q, scales = quant_gemm.quantize_int8(w)
    err = (quant_gemm.dequantize_int8(q, scales) - w).abs()
    assert q.dtype == torch.int8 and scales.shape == (37,)
    assert bool((err <= scales[:, None] / 2 + 1e-7).all())
    assert float(err[3].max()) == 0.0
    assert int(q.abs().max()) == 127  # the range is used fully


def test_nf4_codes_are_the_nearest_table_value_of_each_64_block():
    w = weight(21, 150)  # 150 = two full blocks and a partial one
    codes, absmax = quant_gemm.quantize_nf4(w)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15 and absmax.shape == (21, 3)
    deq = quant_gemm.dequantize_nf4(codes, absmax)
    table = quant_gemm.NF4_TABLE
    half_gap = float((table[1:] - table[:-1]).max()) / 2
    scale = absmax.repeat_interleave(64, dim=1)[:, :150]
    assert bool(((deq - w).abs() <= half_gap * scale + 1e-7).all())
    # nearest: no other table value is closer
    distances = (w[..., None] / scale[..., None] - table).abs()
    assert bool((distances.gather(-1, codes.long()[..., None]) <= distances.min(-1, keepdim=True).values + 1e-6).all())


def test_panel_layouts_unpack_to_the_dequantized_weight():
    w = weight(37, 100)  # neither a multiple of 16 columns nor of 64 weights
    q, scales = quant_gemm.quantize_int8(w)
    assert torch.equal(
        quant_gemm.unpack_int8(*quant_gemm.pack_int8(q, scales), 37), quant_gemm.dequantize_int8(q, scales)
    )
    codes, absmax = quant_gemm.quantize_nf4(w)
    packed = quant_gemm.pack_nf4(codes, absmax)
    assert packed[0].shape == (3, 100, 8)
    assert torch.equal(quant_gemm.unpack_nf4(*packed, 37), quant_gemm.dequantize_nf4(codes, absmax))


@pytest.mark.parametrize(("cls", "ratio"), [(Int8Linear, 0.26), (NF4Linear, 0.15)])
def test_quantized_projection_memory(cls, ratio):
    """The medium model's MLP projection: int8 ≈ 1/4, NF4 ≈ 0.14 of its float32 bytes."""
    linear = nn.Linear(1024, 2816, bias=False)
    module = cls(linear)
    held = sum(t.numel() * t.element_size() for t in vars(module).values() if isinstance(t, torch.Tensor))
    assert held <= ratio * linear.weight.numel() * 4
    assert held == pytest.approx(linear.weight.numel() * BYTES_PER_PARAM[cls.quant], rel=0.01)


# ---------------------------------------------------------------- kernel
@needs_kernel
@pytest.mark.parametrize("cls", [Int8Linear, NF4Linear])
def test_kernel_matches_dequantized_linear_and_rows_are_batch_invariant(cls):
    linear = nn.Linear(100, 37)  # padded last panel, partial NF4 block, bias
    module = cls(linear)
    x = torch.randn(9, 100, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        full = module(x)
        torch.testing.assert_close(full, F.linear(x, module.weight, module.bias), atol=1e-5, rtol=1e-5)
        for start, size in [(0, 1), (4, 1), (2, 3), (5, 4), (1, 7)]:  # every row block shape of the kernel
            assert torch.equal(module(x[start : start + size]), full[start : start + size])
        assert module(x.view(3, 3, 100)).shape == (3, 3, 37)


@needs_kernel
def test_int8_avx512_and_avx2_paths_agree_bit_for_bit():
    module = Int8Linear(nn.Linear(300, 70))
    x = torch.randn(6, 300, generator=torch.Generator().manual_seed(2))
    lib = quant_gemm.load()
    before = lib.swarm_quant_use_avx512(0)
    try:
        with torch.inference_mode():
            avx2 = module(x)
            lib.swarm_quant_use_avx512(1)
            wide = module(x)
    finally:
        lib.swarm_quant_use_avx512(before)
    assert torch.equal(avx2, wide)


def test_gradients_flow_through_the_dequantized_weight():
    linear = nn.Linear(64, 48)
    module = Int8Linear(linear)
    x = torch.randn(2, 3, 64, requires_grad=True)
    module(x).square().sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    F.linear(x2, module.weight, module.bias).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)


# ---------------------------------------------------------------- blocks
def span(model: str, quant: str, start: int = 0, end: int | None = None) -> tuple[SpanRunner, object, object]:
    """Blocks ``[start, end)`` of ``model`` as a server loads them (plain float32 layers for ``none``)."""
    config = AutoConfig.from_pretrained(model)
    family = get_family(config)
    blocks = load_blocks(model, config, family, start, end or config.num_hidden_layers, torch.float32, CPU,
                         cpu_kernels="torch", quant=quant)  # fmt: skip
    return SpanRunner(blocks, torch.float32, CPU), family.cache_layout(config), config


@pytest.mark.parametrize(("quant", "cls", "bound"), [("int8", Int8Linear, 0.02), ("nf4", NF4Linear, 0.35)])
def test_quantized_block_is_the_float_block_with_dequantized_weights(tiny_llama, quant, cls, bound):
    """One block: within ``bound`` of float32 (relative; the tiny model's weights are far larger than a
    trained model's, so errors grow fast over layers), and equal to a float32 block whose projections
    carry the dequantized weights: the quantization is the only difference."""
    full, _, config = span(tiny_llama, "none", 0, 1)
    runner, _, _ = span(tiny_llama, quant, 0, 1)
    block = runner.blocks[0]
    assert type(block.layer.self_attn.q_proj) is cls and type(block.layer.mlp.down_proj) is cls
    x = torch.randn(2, 7, config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want, got = full.forward(x), runner.forward(x)
        relative = float((got - want).norm() / want.norm())
        assert 0 < relative < bound, relative
        plain = dequantized_copy(tiny_llama, runner)
        torch.testing.assert_close(got, plain.forward(x), atol=1e-5, rtol=1e-5)


def dequantized_copy(model: str, runner: SpanRunner) -> SpanRunner:
    """The same span in plain float32 layers, its projections holding ``runner``'s dequantized weights."""
    plain, _, _ = span(model, "none", 0, len(runner.blocks))
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    with torch.no_grad():
        for mine, theirs in zip(plain.blocks, runner.blocks, strict=True):
            for parent in ("self_attn", "mlp"):
                for name in names:
                    if hasattr(getattr(mine.layer, parent), name):
                        src = getattr(getattr(theirs.layer, parent), name).weight
                        getattr(getattr(mine.layer, parent), name).weight.copy_(src)
    return plain


@pytest.mark.parametrize("quant", ["int8", "nf4"])
def test_backward_through_a_quantized_span(tiny_llama, quant):
    """``rpc_backward``'s computation on a quantized span: the gradient of the quantized model."""
    runner, _, config = span(tiny_llama, quant, 0, 2)
    plain = dequantized_copy(tiny_llama, runner)
    x = torch.randn(1, 5, config.hidden_size, generator=torch.Generator().manual_seed(3))
    grad_out = torch.randn(1, 5, config.hidden_size, generator=torch.Generator().manual_seed(4))
    got, _ = runner.backward(x, grad_out)
    want, _ = plain.backward(x, grad_out)
    assert float(got.abs().max()) > 0
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("quant", ["int8", "nf4"])
def test_batched_steps_equal_unbatched_on_a_quantized_span(tiny_llama, quant):
    runner, layout, config = span(tiny_llama, quant)
    lengths, batches = [3, 11, 1, 7], [1, 2, 1, 3]

    def sessions():
        caches = CacheManager(100_000, len(runner.blocks), layout, torch.float32)
        out = []
        for n, (length, batch) in enumerate(zip(lengths, batches, strict=True)):
            cache = caches.open(f"s{n}", batch, 64)
            caches.ensure_capacity(cache, 64)
            runner.inference_step(cache, torch.randn(batch, length, config.hidden_size, generator=gen(n)), 0)
            out.append(cache)
        return out

    def gen(seed: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed)

    alone, together = sessions(), sessions()
    for step in range(4):
        tokens = [torch.randn(b, 1, config.hidden_size, generator=gen(100 * step + i)) for i, b in enumerate(batches)]
        expected = [runner.inference_step(c, t, c.position) for c, t in zip(alone, tokens, strict=True)]
        got = runner.inference_batch([StepItem(c, t, c.position) for c, t in zip(together, tokens, strict=True)])
        for e, g in zip(expected, got, strict=True):
            torch.testing.assert_close(g, e, atol=1e-5, rtol=0)


# ---------------------------------------------------------------- choice, CUDA wiring, display
def test_auto_picks_the_most_precise_quantization_that_fits():
    params = 10**9
    assert choose_quant(params, 4, 8 * 2**30)[0] == "none"  # 4 GB of float32 in 6.4 GB
    assert choose_quant(params, 4, 3 * 2**30)[0] == "int8"  # 1 GB in 2.4 GB
    assert choose_quant(params, 4, int(0.9 * 2**30))[0] == "nf4"  # 0.56 GB in 0.72 GB
    quant, why = choose_quant(params, 4, 2**28)
    assert quant == "nf4" and "exceeds" in why


def test_resolve_quant_reads_the_span_size_from_the_checkpoint(tiny_llama):
    assert resolve_quant("int8", tiny_llama, [], torch.float32, CPU) == "int8"
    assert resolve_quant("auto", tiny_llama, ["model.layers.0."], torch.float32, CPU) == "none"  # a tiny span
    with pytest.raises(ValueError, match="int4"):
        resolve_quant("int4", tiny_llama, [], torch.float32, CPU)


def test_cli_choices_match():
    from swarmserve.cli import worker

    assert tuple(worker.QUANT_CHOICES) == QUANT_CHOICES


def test_cuda_quantization_without_bitsandbytes_says_how_to_install_it():
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("bitsandbytes is installed here")
    block = nn.Sequential()
    block.q_proj = nn.Linear(8, 8)
    with pytest.raises(QuantizationUnavailable, match=r"swarmserve\[cuda\]"):
        quantize_linears_cuda(block, "int8", torch.float16)


def test_status_and_swarm_view_show_the_quantization():
    from gateway.backends.swarm_view import with_quant
    from swarm_client.dht_records import RemoteSpanInfo
    from swarmserve.cli.status import render_status

    def info(quant: str) -> ServerInfo:
        return ServerInfo(state=ServerState.ONLINE, start_block=0, end_block=2, throughput=1.0, quant=quant)

    spans = {
        p: RemoteSpanInfo(peer_id=p, start=0, end=2, server_info=info(q)) for p, q in [("a", "int8"), ("b", "none")]
    }
    text, _ = render_status("m", 2, spans)
    assert "quant" in text.splitlines()[1]
    assert [line.split()[3] for line in text.splitlines()[4:6]] == ["int8", "none"]
    payload = json.loads(render_status("m", 2, spans, as_json=True)[0])
    assert [s["quant"] for s in payload["servers"]] == ["int8", "none"]

    class Backend:
        manager = type("M", (), {"spans": spans})()

    state = with_quant({"spans": [{"peer_id": "b"}, {"peer_id": "a"}]}, Backend())
    assert [row["quant"] for row in state["spans"]] == ["none", "int8"]


# ---------------------------------------------------------------- real workers
def status_json(initial_peers: str, model: str, prefix: str) -> dict:
    argv = swarmserve_argv(
        "status", "--initial-peers", initial_peers, "--model", model, "--dht-prefix", prefix, "--json"
    )
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=child_env(1))
    return json.loads(out.stdout)


@pytest.mark.slow
def test_int8_worker_is_announced_and_routed_by_min_precision(tiny_llama, local_llama):
    from swarm_client import AutoDistributedModelForCausalLM, NoRouteError
    from tests.swarm_fixtures import greedy_route, swarm

    prompt = torch.tensor([[1, 5, 9, 2]])
    with swarm(tiny_llama, []) as s:
        quantized = s.add_worker("--quant", "int8", blocks="0:4")
        assert "quant int8" in quantized.output
        full = s.add_worker(blocks="0:4")
        by_peer = {
            row["peer_id"]: row["quant"] for row in status_json(s.initial_peers, tiny_llama, s.prefix)["servers"]
        }
        assert by_peer == {quantized.peer_id: "int8", full.peer_id: "none"}

        strict = AutoDistributedModelForCausalLM.from_pretrained(
            tiny_llama, initial_peers=[s.initial_peers], min_precision="full", route_wait=2.0
        )
        plain = AutoDistributedModelForCausalLM.from_pretrained(tiny_llama, initial_peers=[s.initial_peers])
        try:
            expected = local_llama.generate(prompt, max_new_tokens=6, do_sample=False)[0, 4:].tolist()
            for _ in range(3):
                tokens, route = greedy_route(strict, prompt, 6)
                assert [hop.peer_id for hop in route] == [full.peer_id] and tokens == expected
            full.stop()
            tokens, route = greedy_route(plain, prompt, 6)  # a default client takes the int8 server
            assert [hop.peer_id for hop in route] == [quantized.peer_id]
            with pytest.raises(NoRouteError, match="min_precision"):
                greedy_route(strict, prompt, 6)
            check_batched_equals_unbatched(plain, quantized.peer_id)
        finally:
            strict.shutdown()
            plain.shutdown()


def check_batched_equals_unbatched(model, peer_id: str) -> None:
    """Four sessions stepped concurrently (the server batches them) give the same outputs as each alone."""
    from swarm_client import runtime

    prompts = [torch.randint(0, 1000, (1, 3 + i), generator=torch.Generator().manual_seed(i)) for i in range(4)]

    async def decode(prompt):
        session = model.blocks.inference_session(max_length=16)
        try:
            out = await session.astep(model.head.embed(prompt))
            outs = [out[:, -1:]]
            for _ in range(5):
                out = await session.astep(model.head.embed(model.head.final(out[:, -1:]).argmax(-1)))
                outs.append(out)
            return torch.cat(outs, 1)
        finally:
            await session.aclose()

    async def together():
        return await asyncio.gather(*(decode(p) for p in prompts))

    with torch.no_grad():
        alone = [runtime.run(decode(p)) for p in prompts]
        batched = runtime.run(together())
    for a, b in zip(alone, batched, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
    assert runtime.run(model.manager.info(peer_id))["max_batch_seen"] > 1
