#!/usr/bin/env bash
# Install everything the test suite needs on a fresh Debian 12 machine (runc,
# CRIU 4.1, containerd, docker, podman, gcc, the Python test tools), then run the linter
# and the whole suite. Run as root: the end-to-end tests drive
# real runc and CRIU. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ $(id -u) -ne 0 ]]; then
    echo "test.sh: run as root (the end-to-end tests drive runc and CRIU)" >&2
    exit 1
fi
# The suite's own CRIU, beside the checkout: never the node's install (which
# install.sh --with-criu puts in /opt/cudahook/criu and --uninstall removes).
bash scripts/provision-criu.sh --prefix "$PWD/.cache/criu" --link ""
bash scripts/provision-runtimes.sh
bash scripts/dev-env.sh --test
# Test tools from Debian: gcc builds the simulated node's libcuda.so.1 (C);
# logrotate checks the rule install.sh puts in /etc/logrotate.d.
missing=()
command -v gcc >/dev/null || missing+=(gcc libc6-dev)
command -v logrotate >/dev/null || [[ -x /usr/sbin/logrotate ]] || missing+=(logrotate)
if ((${#missing[@]})); then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
.venv/bin/ruff check .
export CUDAHOOK_CRIU="$PWD/.cache/criu/bin/criu"
exec .venv/bin/python -m pytest "$@"
