"""Session-wide fixtures: tiny models built once per test run, offline."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


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
