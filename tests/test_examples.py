"""Every script in ``examples/`` runs against a real local swarm, exits 0 and prints what it promises."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from tests.swarm_fixtures import swarm

pytestmark = pytest.mark.slow

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
TIMEOUT = 240

#: script → lines (prefixes) its output must contain
EXPECTED: dict[str, list[str]] = {
    "hidden_states.py": ["hidden states: 5 tensors for 4 blocks", "slice matches full run: True"],
    "custom_paths.py": [
        "blocks[:2] then blocks[2:] equals blocks(x): True",
        "skip block 1: output (2, 5, 64), differs from the full path: True",
        "repeat block 1: output (2, 5, 64), differs from the full path: True",
        "local module between remote blocks trained: True",
    ],
    "custom_sampling.py": ["sampled:", "greedy loop matches generate(): True"],
    "prompt_tuning.py": [
        "soft prompt: loss decreased",
        "deep prompts: loss decreased",
        "all modes: loss decreased",
    ],
    "classification_head.py": ["features: (8, 64) from 4 remote blocks", "loss decreased"],
    "lora_training.py": [
        "local block LoRA got gradients: True",
        "lora + deep prompts: loss decreased",
        "reloaded adapter gives the same loss: True",
    ],
}


@pytest.fixture(scope="module")
def initial_peers(tiny_llama) -> str:
    with swarm(tiny_llama, ["0:2", "2:4"]) as s:
        yield s.initial_peers


def test_every_example_is_tested() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(EXPECTED)


@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_example_runs(script: str, tiny_llama: str, initial_peers: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--model", tiny_llama, "--initial-peers", initial_peers],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env,
    )
    assert result.returncode == 0, f"{script} failed:\n{result.stdout}\n{result.stderr[-4000:]}"
    lines = result.stdout.splitlines()
    for expected in EXPECTED[script]:
        assert any(line.startswith(expected) for line in lines), f"{script}: no line {expected!r} in\n{result.stdout}"
