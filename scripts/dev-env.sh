#!/usr/bin/env bash
# Create (or update) the project's virtual environment in .venv on the system
# interpreter, which starts several times faster than a pyenv shim.
# Usage: scripts/dev-env.sh [--test]   (--test also installs the test tools)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${CUDAHOOK_PYTHON:-/usr/bin/python3}
if ! "$PY" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
        echo "dev-env: installing python3 and python3-venv"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3 python3-venv >/dev/null
    else
        echo "dev-env: need Python >= 3.11 with venv at $PY (set CUDAHOOK_PYTHON)" >&2
        exit 1
    fi
fi
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
extra=""
[[ ${1:-} == --test ]] && extra="[test]"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".${extra}"
