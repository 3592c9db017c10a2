#!/usr/bin/env bash
# Install cudahook into .venv and run the demo on a simulated GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/dev-env.sh
exec .venv/bin/cudahook-sim demo
