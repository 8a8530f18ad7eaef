"""Packed projections (our panel kernel, oneDNN) give the numbers of the plain torch layers, for inference and
for gradients; the panel kernel's rows do not depend on the batch they were computed in."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from swarm_client.kernels import cpu_gemm
from swarm_client.kernels.cpu_kernels import (
    PackedLinear,
    PanelLinear,
    pack_linears,
    packing_supported,
    resolve_cpu_kernels,
)
from tests.test_batching import make_sessions, runner_and_layout  # noqa: F401 - fixture
from worker.compute import SpanRunner, StepItem

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(not packing_supported(CPU, torch.float32), reason="oneDNN not in this torch")
#: on x86 with AVX2 and a compiler (every development and CI machine here) the kernel must build: a
#: silent fallback would hide a broken kernel behind oneDNN
needs_panels = pytest.mark.skipif(not cpu_gemm.cpu_has_avx2_fma(), reason="this CPU lacks AVX2/FMA")
KINDS = [pytest.param("panels", marks=needs_panels), pytest.param("onednn", marks=needs_onednn)]
PACKERS = {"panels": PanelLinear, "onednn": PackedLinear}


@needs_panels
def test_panel_kernel_builds_here():
    assert cpu_gemm.load() is not None, cpu_gemm.load_error()
    assert resolve_cpu_kernels("auto", CPU, torch.float32) == "panels"


@needs_panels
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 33])
@pytest.mark.parametrize(("k", "n"), [(64, 96), (37, 100), (256, 17), (1, 5)])
def test_panel_linear_matches_linear_for_every_row_count(rows, k, n):
    torch.manual_seed(rows * 1000 + k + n)
    linear = nn.Linear(k, n, bias=bool(rows % 2))
    panel = PanelLinear(linear)
    x = torch.randn(rows, k)
    with torch.inference_mode():
        torch.testing.assert_close(panel(x), linear(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(panel.weight, linear.weight.detach())


@needs_panels
def test_panel_rows_are_bit_identical_whatever_the_batch():
    """Each output is one FMA chain over k in order, so batching never changes a single bit."""
    torch.manual_seed(0)
    panel = PanelLinear(nn.Linear(300, 200))
    x = torch.randn(11, 300)
    with torch.inference_mode():
        full = panel(x)
        for i in range(11):
            assert torch.equal(panel(x[i : i + 1]), full[i : i + 1])
        for a, b in [(0, 4), (3, 6), (2, 11)]:
            assert torch.equal(panel(x[a:b]), full[a:b])


@needs_panels
def test_panel_threads_split_columns_without_changing_results():
    torch.manual_seed(0)
    panel = PanelLinear(nn.Linear(128, 1000))
    x = torch.randn(6, 128)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with torch.inference_mode():
            one = panel(x)
        torch.set_num_threads(3)
        with torch.inference_mode():
            three = panel(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, three)


def test_resolve_cpu_kernels_falls_back():
    assert resolve_cpu_kernels("auto", CPU, torch.bfloat16) == "torch"
    assert resolve_cpu_kernels("panels", torch.device("cuda"), torch.float32) == "torch"
    assert resolve_cpu_kernels("torch", CPU, torch.float32) == "torch"
    with pytest.raises(ValueError, match="unknown cpu kernels"):
        resolve_cpu_kernels("fast", CPU, torch.float32)


@needs_onednn
def test_a_kernel_that_cannot_build_falls_back_to_onednn(tmp_path):
    """No usable compiler (here: one that always fails) → oneDNN, with the reason in the log."""
    code = (
        "import logging, torch; logging.basicConfig(level=logging.INFO)\n"
        "from swarm_client.kernels.cpu_kernels import resolve_cpu_kernels\n"
        "from swarm_client.kernels import cpu_gemm\n"
        "print(resolve_cpu_kernels('auto', torch.device('cpu'), torch.float32))\n"
        "print(cpu_gemm.load_error())\n"
    )
    env = {**os.environ, "CXX": "false", "SWARMSERVE_CACHE": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0] == "onednn"
    if cpu_gemm.cpu_has_avx2_fma():
        assert "false" in lines[1] and "failed" in lines[1]
        assert "using oneDNN" in result.stderr


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 64), (3, 1, 64), (2, 7, 64)])
def test_packed_linear_matches_linear(kind, bias, shape):
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=bias)
    packed = PACKERS[kind](linear)
    x = torch.randn(*shape)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed.weight, linear.weight.detach())


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_flow_through_packed_linear(kind):
    torch.manual_seed(0)
    linear = nn.Linear(64, 32)
    packed = PACKERS[kind](linear)
    x1 = torch.randn(5, 64, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    (linear(x1) ** 2).sum().backward()
    (packed(x2) ** 2).sum().backward()
    torch.testing.assert_close(x2.grad, x1.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_packed_blocks_match_plain_blocks(kind, runner_and_layout):  # noqa: F811
    """Prefill, single steps, a batch of sessions, and the backward recomputation of a span."""
    runner, layout, _ = runner_and_layout
    blocks = [copy.deepcopy(b) for b in runner.blocks]
    assert sum(pack_linears(b, kind) for b in blocks) == 7 * len(blocks)
    packed = SpanRunner(blocks, torch.float32, torch.device("cpu"))

    lengths, batches = [3, 11, 1, 7], [1, 2, 1, 3]
    plain_sessions = make_sessions(runner, layout, lengths, batches)
    packed_sessions = make_sessions(packed, layout, lengths, batches)
    for step in range(4):
        tokens = [
            torch.randn(b, 1, 64, generator=torch.Generator().manual_seed(10 * step + i))
            for i, b in enumerate(batches)
        ]
        expected = [runner.inference_step(c, t, c.position) for c, t in zip(plain_sessions, tokens, strict=True)]
        got = packed.inference_batch(
            [StepItem(c, t, c.position) for c, t in zip(packed_sessions, tokens, strict=True)]
        )
        for e, g in zip(expected, got, strict=True):
            torch.testing.assert_close(g, e, atol=1e-4, rtol=0)  # the tolerance of every swarm test

    hidden = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(7))
    grad_out = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(packed.forward(hidden), runner.forward(hidden), atol=1e-4, rtol=0)
    grad_packed, _ = packed.backward(hidden, grad_out)
    grad_plain, _ = runner.backward(hidden, grad_out)
    torch.testing.assert_close(grad_packed, grad_plain, atol=1e-4, rtol=0)


def test_command_lines_offer_exactly_the_kernels_there_are():
    """``swarmserve worker`` and the benchmark spell the choices out (no torch import at parse time)."""
    from load_tests.bench_concurrency import parse_args
    from swarm_client.kernels.cpu_kernels import CPU_KERNELS
    from swarmserve.cli import build_parser

    worker = build_parser()._subparsers._group_actions[0].choices["worker"]  # type: ignore[union-attr]
    (option,) = [a for a in worker._actions if "--cpu-kernels" in a.option_strings]
    assert tuple(option.choices) == CPU_KERNELS
    bench = parse_args([])
    assert bench.cpu_kernels == "auto"
    for kind in CPU_KERNELS:
        assert parse_args(["--cpu-kernels", kind]).cpu_kernels == kind
    with pytest.raises(SystemExit):
        parse_args(["--cpu-kernels", "fast"])
