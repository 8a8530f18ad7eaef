"""Peak memory of loading one span of blocks vs. every block vs. the whole 🤗 model (separate processes).

    python load_tests/bench_rss.py --model medium     # hidden 1024, 8 layers, ~0.4 GB float32

Each measurement runs in a fresh child process and reports how much its resident memory grew from just
before loading to just after (libraries already imported), i.e. the weights' own footprint.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHILD = r"""
import gc, sys, psutil, torch
from transformers import AutoConfig, AutoModelForCausalLM
from swarm_client.families import get_family
from worker.loading import load_blocks
mode, path = sys.argv[1], sys.argv[2]
config = AutoConfig.from_pretrained(path)
before = psutil.Process().memory_info().rss
if mode.startswith("blocks:"):
    a, b = (int(x) for x in mode.split(":")[1:])
    blocks = load_blocks(path, config, get_family(config), a, b, torch.float32, torch.device("cpu"), cpu_kernels="auto")
elif mode == "full":
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
# touch every weight: safetensors maps files lazily, and untouched pages are not resident yet
modules = blocks if mode.startswith("blocks:") else [model]
sum(float(p.detach().sum()) for m in modules for p in m.parameters())
gc.collect()
print((psutil.Process().memory_info().rss - before) // 2**20)
"""


def rss_growth_mb(mode: str, path: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode, path], capture_output=True, text=True, check=True, cwd=ROOT
    )
    return int(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="medium", help="tiny | medium | smollm | a local model directory")
    parser.add_argument("--out", default="bench_results/rss.json")
    args = parser.parse_args()
    from transformers import AutoConfig

    from load_tests.bench_decode import resolve_model

    with tempfile.TemporaryDirectory(prefix="bench-rss-") as tmp:
        path = resolve_model(args.model, Path(tmp))
        layers = AutoConfig.from_pretrained(path).num_hidden_layers
        quarter = max(1, layers // 4)
        results = {
            "model": args.model,
            "layers": layers,
            f"span_0:{quarter}_mb": rss_growth_mb(f"blocks:0:{quarter}", path),
            f"all_blocks_0:{layers}_mb": rss_growth_mb(f"blocks:0:{layers}", path),
            "full_hf_model_mb": rss_growth_mb("full", path),
        }
    for key, value in results.items():
        print(f"{key}: {value}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
