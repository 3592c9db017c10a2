#!/usr/bin/env bash
# Install everything the test suite needs on a fresh Debian 12 machine (runc,
# CRIU 4.1, containerd, docker, the Python test tools), then run the linter
# and the whole suite. Run as root: the end-to-end tests drive
# real runc and CRIU. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ $(id -u) -ne 0 ]]; then
    echo "test.sh: run as root (the end-to-end tests drive runc and CRIU)" >&2
    exit 1
fi
bash scripts/provision-criu.sh
bash scripts/provision-runtimes.sh
bash scripts/dev-env.sh --test
.venv/bin/ruff check .
exec .venv/bin/python -m pytest "$@"
