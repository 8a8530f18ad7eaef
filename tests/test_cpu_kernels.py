"""oneDNN-packed projections give the numbers of the plain torch layers, for inference and for gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.test_batching import make_sessions, runner_and_layout  # noqa: F401 - fixture
from worker.compute import SpanRunner, StepItem
from worker.cpu_kernels import PackedLinear, pack_linears, packing_supported

pytestmark = pytest.mark.skipif(
    not packing_supported(torch.device("cpu"), torch.float32), reason="oneDNN not available in this torch"
)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 64), (3, 1, 64), (2, 7, 64)])
def test_packed_linear_matches_linear(bias, shape):
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=bias)
    packed = PackedLinear(linear)
    x = torch.randn(*shape)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed.weight, linear.weight.detach())


def test_gradients_flow_through_packed_linear():
    torch.manual_seed(0)
    linear = nn.Linear(64, 32)
    packed = PackedLinear(linear)
    x1 = torch.randn(5, 64, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    (linear(x1) ** 2).sum().backward()
    (packed(x2) ** 2).sum().backward()
    torch.testing.assert_close(x2.grad, x1.grad, atol=1e-5, rtol=1e-5)


def test_packed_blocks_match_plain_blocks(runner_and_layout):  # noqa: F811
    """Prefill, single steps, a batch of sessions, and the backward recomputation of a span."""
    runner, layout, _ = runner_and_layout
    blocks = [copy.deepcopy(b) for b in runner.blocks]
    assert sum(pack_linears(b) for b in blocks) == 7 * len(blocks)
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
