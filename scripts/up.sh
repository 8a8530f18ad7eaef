#!/usr/bin/env bash
# Install and start the embedded default: DHT + local block servers + gateway (the README's main command).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh smollm
# shellcheck disable=SC1091
. .venv/bin/activate
exec swarmserve up --model "${MODEL:-HuggingFaceTB/SmolLM2-135M-Instruct}" "$@"
