"""Session-wide fixtures: tiny models built once per test run, offline."""

from __future__ import annotations

import os
import traceback

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# CPython 3.11's ``ast.parse`` keeps its recursion counter in per-interpreter state, so a second
# ``ast.parse`` that starts while one is converting its tree corrupts the first ("SystemError: AST
# constructor recursion depth mismatch"). 3.11's traceback formatting calls ``ast.parse`` for its caret
# anchors, and tracebacks get formatted inside garbage collection: pytest's unraisable-exception hook and
# logging both format the traceback of an exception raised by a ``__del__`` (hivemind's p2p clients raise
# one when collected after their event loop closed). When that collection runs inside pytest's own
# ``ast.parse`` of a failing test's source, pytest dies with INTERNALERROR (exit 3) instead of reporting the
# failure. Tracebacks without caret anchors (``~~~^^^``) read the same, and no formatting re-enters the
# parser. tests/test_conftest_ast.py reproduces the crash and shows it gone.
traceback._extract_caret_anchors_from_line_segment = lambda segment: None  # noqa: SLF001


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    from swarm_client.tiny_model import make_tiny_model

    return str(
        make_tiny_model(
            tmp_path_factory.mktemp("models") / "tiny-llama", family="llama", num_layers=4, seed=0
        )
    )


@pytest.fixture(scope="session")
def local_llama(tiny_llama):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
