"""``swarmserve up`` / ``gateway`` / ``status`` as a user runs them: real subprocesses, real ports.

One ``swarmserve up`` (tiny Llama, two workers) serves the whole module; the last test sends it SIGINT
and checks that every process it started — workers, their DHT processes and p2pd daemons, its own DHT —
is gone. The pure helpers (span splitting, the status table) get fast tests of their own.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from swarm_client.dht_records import RemoteSpanInfo, ServerInfo, ServerState
from swarmserve.cli.status import render_status
from swarmserve.launcher import ChildProcess, split_blocks, swarmserve_argv
from tests.gateway_fixtures import assert_greedy, chat_prompt_ids

HELLO = [{"role": "user", "content": "Hello, swarm!"}]
URL_LINE = re.compile(r"OpenAI base URL: (http://\S+/v1)")
START_TIMEOUT = 180.0


# ------------------------------------------------------------------------------------------- helpers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


class Cli(ChildProcess):
    """A ``swarmserve`` subprocess in its own process group, its output collected line by line."""

    @classmethod
    def start(cls, *args: str) -> Cli:
        return cls.spawn(f"swarmserve {args[0]}", args, _env())


def _run(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        swarmserve_argv(*args),
        capture_output=True,
        text=True,
        env=_env(),
        timeout=timeout,
    )


# ------------------------------------------------------------------------------------------- pure parts
def test_split_blocks_is_even_and_contiguous() -> None:
    assert split_blocks(4, 2) == [(0, 2), (2, 4)]
    assert split_blocks(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert split_blocks(3, 5) == [(0, 1), (1, 2), (2, 3)]  # never an empty span
    with pytest.raises(ValueError):
        split_blocks(4, 0)


def _span(
    peer: str, start: int, end: int, state: ServerState = ServerState.ONLINE, adapters: tuple[str, ...] = ()
) -> RemoteSpanInfo:
    info = ServerInfo(
        state=state, start_block=start, end_block=end, throughput=12.5, cache_tokens_left=999, adapters=adapters
    )
    return RemoteSpanInfo(peer, start, end, info)


@pytest.mark.parametrize("command", ["gateway", "up"])
def test_pipeline_groups_flag_is_auto_by_default_and_checked(command: str) -> None:
    """``--pipeline-groups`` takes "auto" (the default: one group per server of a route) or 1..64."""
    from load_tests.bench_concurrency import parse_args
    from swarmserve.cli import build_parser

    base = ["--model", "m"] + (["--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/x"] if command == "gateway" else [])
    parser = build_parser()
    assert parser.parse_args([command, *base]).pipeline_groups == "auto"
    assert parser.parse_args([command, *base, "--pipeline-groups", "3"]).pipeline_groups == 3
    for bad in ("0", "65", "two", "Auto"):
        with pytest.raises(SystemExit):
            parser.parse_args([command, *base, "--pipeline-groups", bad])
    assert parse_args([]).pipeline_groups == "auto"
    assert parse_args(["--pipeline-groups", "1"]).pipeline_groups == 1


def test_cli_version_help_and_checked_flags() -> None:
    from swarmserve import __version__
    from swarmserve.cli import build_parser

    version = _run("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"swarmserve {__version__}"
    up_help = " ".join(_run("up", "--help").stdout.split())  # argparse wraps at the terminal width
    assert "(default: 2)" in up_help and "(default: HuggingFaceTB/SmolLM2-135M-Instruct)" in up_help
    assert "(default: 127.0.0.1)" in up_help and "(default: 8000)" in up_help
    parser = build_parser()
    assert parser.parse_args(["--log-level", "debug", "status", "--initial-peers", "x"]).log_level == "DEBUG"
    for bad in (["--log-level", "LOUD", "status", "--initial-peers", "x"], ["up", "--port", "70000"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
    # status without --model reads the model `swarmserve up` serves by default
    args = parser.parse_args(["status", "--initial-peers", "x"])
    assert args.model is None and args.num_blocks is None


def test_render_status_flags_gaps() -> None:
    spans = {"peerA": _span("peerA", 0, 3, adapters=("a1",)), "peerB": _span("peerB", 3, 5, ServerState.JOINING)}
    text, missing = render_status("m", 6, spans)
    assert missing == [3, 4, 5]
    assert "adapter 'a1': peerA (0:3)" in text
    assert json.loads(render_status("m", 6, spans, as_json=True)[0])["servers"][0]["adapters"] == ["a1"]
    assert "NOT COVERED: blocks 3..5" in text
    assert "peerA" in text and "JOINING" in text and "999" in text
    row_a = next(line for line in text.splitlines() if line.startswith("peerA"))
    assert row_a.endswith("███···")

    text, missing = render_status("m", 3, {"peerA": spans["peerA"]})
    assert missing == [] and "fully covered" in text


# ------------------------------------------------------------------------------------------- swarmserve up
@dataclass
class Up:
    cli: Cli
    base_url: str
    dht_maddr: str
    model_dir: str
    status_line: str


@pytest.fixture(scope="module")
def lora(tiny_llama: str, tmp_path_factory) -> tuple[str, str]:
    """(a random LoRA adapter of the tiny model, the tiny model with it merged by PEFT, saved with its tokenizer)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swarm_client.tiny_lora import make_random_lora

    root = tmp_path_factory.mktemp("up-lora")
    adapter = str(make_random_lora(tiny_llama, root / "a1", seed=1))
    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    PeftModel.from_pretrained(base, adapter).merge_and_unload().save_pretrained(root / "merged")
    AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(root / "merged")
    return adapter, str(root / "merged")


@pytest.fixture(scope="module")
def up(tiny_llama: str, lora: tuple[str, str]) -> Iterator[Up]:
    port = _free_port()
    cli = Cli.start(
        "up",
        "--model",
        tiny_llama,
        "--workers",
        "2",
        "--port",
        str(port),
        "--throughput",
        "1000",
        "--grace",
        "10",
        "--adapters",
        f"a1={lora[0]}",
    )
    try:
        dht = cli.wait_for(re.compile(r"DHT at (\S+)"), START_TIMEOUT).group(1)
        base_url = cli.wait_for(URL_LINE, START_TIMEOUT).group(1)
        assert base_url == f"http://127.0.0.1:{port}/v1"
        cli.wait_for(re.compile(r"curl -N "), 5)
        status_line = cli.wait_for(re.compile(r"^\s+(\S.* status --initial-peers .*)$"), 5).group(1)
        yield Up(cli, base_url, dht, tiny_llama, status_line)
    finally:
        if cli.popen.poll() is None:  # the last test did not get to stop it: still stop it cleanly
            cli.popen.send_signal(signal.SIGINT)
            try:
                cli.popen.wait(60)
            except subprocess.TimeoutExpired:
                pass
        cli.kill_group()


def test_up_serves_the_openai_api(up: Up) -> None:
    client = openai.OpenAI(base_url=up.base_url, api_key="x", timeout=30, max_retries=0)
    r = client.chat.completions.create(model="tiny-llama", messages=HELLO, max_tokens=8, temperature=0)
    # the whole swarm up started answers exactly as 🤗 transformers decodes the checkpoint greedily
    assert_greedy(r, chat_prompt_ids(HELLO, up.model_dir), 8, up.model_dir)
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="tiny-llama", messages=HELLO, max_tokens=8, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == r.choices[0].message.content
    health = httpx.get(up.base_url.removesuffix("/v1") + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["num_blocks"] == 4


def test_up_serves_its_lora_adapter_as_a_model(up: Up, lora: tuple[str, str]) -> None:
    """``up --adapters a1=PATH``: every worker serves it, the gateway lists ``tiny-llama:a1`` and answers it
    exactly as 🤗 with the adapter merged by PEFT."""
    assert re.search(r"LoRA adapters, each a model: \S+:a1", up.cli.output)
    client = openai.OpenAI(base_url=up.base_url, api_key="x", timeout=30, max_retries=0)
    deadline = time.monotonic() + 30
    while not any(m.id.endswith(":a1") for m in client.models.list().data):  # the swarm view refreshes
        assert time.monotonic() < deadline, [m.id for m in client.models.list().data]
        time.sleep(0.5)
    (name,) = [m.id for m in client.models.list().data if m.id.endswith(":a1")]
    r = client.chat.completions.create(model=name, messages=HELLO, max_tokens=8, temperature=0)
    assert r.model == name
    assert_greedy(r, chat_prompt_ids(HELLO, up.model_dir), 8, lora[1])


def test_status_against_a_running_swarm(up: Up) -> None:
    command = shlex.split(up.status_line)
    assert command[-5:] == ["status", "--initial-peers", up.dht_maddr, "--model", up.model_dir]
    ok = _run(*command[-5:])
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "fully covered" in ok.stdout
    rows = [line.split() for line in ok.stdout.splitlines() if re.search(r" \d+:\d+ +ONLINE ", line)]
    assert sorted(row[1] for row in rows) == ["0:2", "2:4"], ok.stdout

    # claim the model has 6 blocks: 4 and 5 have no server
    gap = _run("status", "--initial-peers", up.dht_maddr, "--dht-prefix", "tiny-llama", "--num-blocks", "6")
    assert gap.returncode == 1, gap.stdout + gap.stderr
    assert "NOT COVERED: blocks 4..5" in gap.stdout


def test_status_command_works_as_pasted_into_a_new_shell(up: Up, tmp_path: Path) -> None:
    """Issue 36: the status command `up` prints works in a new terminal, where the virtual environment
    `up` runs from is not active (no `swarmserve` on PATH), from any directory."""
    assert os.path.isabs(shlex.split(up.status_line)[0]), up.status_line
    path = os.pathsep.join(d for d in os.defpath.split(os.pathsep) if d and not shutil.which("swarmserve", path=d))
    env = {"PATH": path, "HOME": os.environ.get("HOME", str(tmp_path)), "HF_HUB_OFFLINE": "1"}
    assert subprocess.run(["bash", "-c", "command -v swarmserve"], env=env, capture_output=True).returncode != 0
    pasted = subprocess.run(
        ["bash", "-c", up.status_line], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert pasted.returncode == 0, pasted.stdout + pasted.stderr
    assert "fully covered" in pasted.stdout and re.search(r" 0:2 +ONLINE ", pasted.stdout), pasted.stdout


def test_up_shows_one_model_name(up: Up) -> None:
    """Issue 36: the name `up` prints is the one /v1/models, /health and answers use (a model served by
    its path: the directory's name); the path still selects it."""
    assert "(model: 'tiny-llama')" in up.cli.output
    assert '"model": "tiny-llama"' in next(line for line in up.cli.lines if "curl -N " in line)
    client = openai.OpenAI(base_url=up.base_url, api_key="x", timeout=30, max_retries=0)
    assert client.models.list().data[0].id == "tiny-llama"
    health = httpx.get(up.base_url.removesuffix("/v1") + "/health", timeout=10)
    assert health.json()["model"] == "tiny-llama"
    r = client.chat.completions.create(model=up.model_dir, messages=HELLO, max_tokens=2)
    assert r.model == "tiny-llama"


def test_gateway_command_joins_the_swarm(up: Up) -> None:
    port = _free_port()
    gw = Cli.start("gateway", "--model", up.model_dir, "--initial-peers", up.dht_maddr, "--port", str(port))
    try:
        base_url = gw.wait_for(URL_LINE, START_TIMEOUT).group(1)
        assert base_url == f"http://127.0.0.1:{port}/v1"
        client = openai.OpenAI(base_url=base_url, api_key="x", timeout=30, max_retries=0)
        text = client.completions.create(model="tiny-llama", prompt="The swarm", max_tokens=6, temperature=0)
        via_up = openai.OpenAI(base_url=up.base_url, api_key="x", timeout=30, max_retries=0)
        same = via_up.completions.create(model="tiny-llama", prompt="The swarm", max_tokens=6, temperature=0)
        assert text.choices[0].text == same.choices[0].text
        gw.popen.send_signal(signal.SIGTERM)
        assert gw.popen.wait(30) == 0, gw.output
    finally:
        gw.kill_group()


def test_sigint_stops_every_process_it_started(up: Up) -> None:
    """Runs last: stops the module's ``up``."""
    parent = psutil.Process(up.cli.popen.pid)
    descendants = parent.children(recursive=True)
    names = sorted(p.name() for p in descendants)
    assert sum("p2pd" in n for n in names) >= 3, names  # ours + one per worker
    assert len(descendants) >= 2 + 3  # two workers, their DHT processes, daemons, our DHT process

    up.cli.popen.send_signal(signal.SIGINT)
    assert up.cli.popen.wait(60) == 0, up.cli.output
    gone, alive = psutil.wait_procs(descendants, timeout=30)
    assert not alive, f"orphans: {[(p.pid, p.name()) for p in alive]}\n{up.cli.output}"
    assert "swarmserve up: stopped" in up.cli.output


def test_up_reports_a_worker_that_dies(tmp_path: Path, tiny_llama: str) -> None:
    broken = tmp_path / "no-weights"
    broken.mkdir()
    for f in Path(tiny_llama).iterdir():
        if not f.name.endswith(".safetensors") and f.is_file():
            shutil.copy(f, broken / f.name)
    cli = Cli.start("up", "--model", str(broken), "--workers", "1", "--port", "0", "--throughput", "1000")
    try:
        assert cli.popen.wait(START_TIMEOUT) == 1, cli.output
    finally:
        cli.kill_group()
    time.sleep(0.2)
    assert "before it was ready; its last lines" in cli.output, cli.output
    assert "no model.safetensors" in cli.output  # the worker's own error, shown to the user
