#!/usr/bin/env bash
# Install cudahook: its own virtual environment on the system Python (which
# starts fastest: the hooks run dozens of times per checkpoint), the hook
# executables, /etc/cudahook/config.yaml, and the CRIU action script in
# /etc/criu/runc.conf. Idempotent. Every file outside the prefix that it
# changes is journaled, and --uninstall puts each one back byte for byte.
#
# Usage: sudo ./install.sh [options]
#   --prefix DIR        install here (default /opt/cudahook)
#   --runtime NAME      also register with runc|containerd|docker|podman|crio (repeatable)
#   --default-runtime   with --runtime docker: make cudahook docker's default runtime
#   --with-criu         provide a working CRIU >= 4.0 if the system's is missing, old or broken
#   --dev               also install the test dependencies
#   --dry-run           show every change, make none
#   --uninstall         undo everything install.sh and `cudahook configure` did
#   -h, --help
set -euo pipefail

SRC=$(cd "$(dirname "$0")" && pwd)
PREFIX=/opt/cudahook
RUNTIMES=()
DEFAULT_RT=""
WITH_CRIU=0
DEV=0
DRY=""
UNINSTALL=0
PY=${CUDAHOOK_PYTHON:-/usr/bin/python3}

die() { echo "install.sh: $*" >&2; exit 1; }
say() { echo "==> $*"; }

while (($#)); do
    case $1 in
        --prefix) [[ $# -ge 2 ]] || die "--prefix needs a directory"; PREFIX=$2; shift 2 ;;
        --prefix=*) PREFIX=${1#*=}; shift ;;
        --runtime) [[ $# -ge 2 ]] || die "--runtime needs a name"; RUNTIMES+=("$2"); shift 2 ;;
        --runtime=*) RUNTIMES+=("${1#*=}"); shift ;;
        --default-runtime) DEFAULT_RT=--default-runtime; shift ;;
        --with-criu) WITH_CRIU=1; shift ;;
        --dev) DEV=1; shift ;;
        --dry-run) DRY=--dry-run; shift ;;
        --uninstall) UNINSTALL=1; shift ;;
        -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option: $1 (see --help)" ;;
    esac
done
[[ $PREFIX == /* ]] || die "--prefix must be an absolute path: $PREFIX"
PREFIX=${PREFIX%/}
for rt in "${RUNTIMES[@]}"; do
    case $rt in runc|containerd|docker|podman|crio) ;; *) die "unknown runtime: $rt" ;; esac
done
[[ $(id -u) -eq 0 ]] || die "run as root: the hooks and /etc/criu/runc.conf are root's"

installer() {  # the journaled file changes, with whichever Python is there
    local py=$PY
    [[ -x $PREFIX/venv/bin/python ]] && py=$PREFIX/venv/bin/python
    PYTHONPATH=$SRC "$py" -I -c 'import sys; sys.path.insert(0, sys.argv.pop(1)); from cudahook.admin.installer import main; sys.exit(main())' "$SRC" "$@"
}

if ((UNINSTALL)); then
    say "reverting every file cudahook changed"
    installer uninstall --prefix "$PREFIX" $DRY
    if [[ -z $DRY && -e $PREFIX/.installed-by-cudahook ]]; then
        say "removing $PREFIX"
        rm -rf -- "$PREFIX"
    fi
    exit 0
fi

"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null \
    || die "need Python >= 3.11 at $PY (set CUDAHOOK_PYTHON)"
if ! "$PY" -c 'import venv, ensurepip' 2>/dev/null; then
    [[ -n $DRY ]] && say "would install python3-venv" || {
        say "installing python3-venv"
        command -v apt-get >/dev/null || die "python3-venv missing and no apt-get to install it"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
    }
fi

if ((WITH_CRIU)); then
    if [[ -n $DRY ]]; then say "would provide CRIU >= 4.0 (scripts/provision-criu.sh)"
    else say "providing CRIU >= 4.0"; bash "$SRC/scripts/provision-criu.sh"; fi
elif ! command -v criu >/dev/null; then
    echo "install.sh: warning: no criu on PATH; use --with-criu for a working CRIU >= 4.0" >&2
fi

if [[ -n $DRY ]]; then
    say "would create $PREFIX/venv and install cudahook from $SRC"
else
    say "installing cudahook into $PREFIX/venv"
    if [[ ! -d $PREFIX ]]; then mkdir -p "$PREFIX"; touch "$PREFIX/.installed-by-cudahook"; fi
    [[ -x $PREFIX/venv/bin/python ]] || "$PY" -m venv "$PREFIX/venv"
    extra=""; ((DEV)) && extra="[test]"
    "$PREFIX/venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade "$SRC$extra" \
        || die "pip install failed"
fi
rtargs=()
for rt in "${RUNTIMES[@]}"; do rtargs+=(--runtime "$rt"); done
installer install --prefix "$PREFIX" --python "$PREFIX/venv/bin/python" --source "$SRC" \
    "${rtargs[@]}" $DEFAULT_RT $DRY
[[ -n $DRY ]] || say "done: run 'cudahook doctor' to check the node"
