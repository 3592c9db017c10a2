#!/usr/bin/env bash
# Install cudahook: its own virtual environment on the system Python (which
# starts fastest: the hooks run dozens of times per checkpoint), the hook
# executables, /etc/cudahook/config.yaml, /etc/logrotate.d/cudahook, the node
# agent's systemd unit (cudahook-agent.service), and the CRIU action script
# in /etc/criu/runc.conf. Where systemd runs (PID 1), the unit is enabled and
# started with --agent or `agent: auto` in the configuration, and a running
# agent is restarted on the new code (elsewhere: restarted if running, else
# hooks start it on demand with `agent: auto`). Idempotent: running it again
# also repairs a half-removed installation. Every file outside the prefix that
# it changes is journaled per prefix, and --uninstall puts each one back byte
# for byte.
#
# Usage: sudo ./install.sh [options]
#   --prefix DIR        install here (default /opt/cudahook)
#   --runtime NAME      also register with runc|containerd|docker|podman|crio (repeatable)
#   --default-runtime   with --runtime docker: make cudahook docker's default runtime
#   --criu-registration global|gpu-only
#                       global (the default on a new install): the CRIU action script
#                       in /etc/criu/runc.conf, run for every container's checkpoint;
#                       gpu-only: the runtime wrapper gives each GPU container a CRIU
#                       configuration naming it, so other containers pay nothing, but
#                       containers created without the wrapper are not covered
#   --with-criu         provide a working CRIU >= 4.0 in PREFIX/criu, linked as
#                       /usr/local/sbin/criu (removed again by --uninstall)
#   --agent             run the node agent as a systemd service (enable + start
#                       cudahook-agent.service; `agent: auto` in the configuration
#                       does the same); without systemd it starts on demand
#   --force             install even though cudahook is installed at another prefix
#                       (uninstalling this one then puts that one back)
#   --dev               also install the test dependencies
#   --dry-run           show every change, make none
#   --uninstall         undo everything install.sh and `cudahook configure` did at
#                       this prefix: the agent stopped (and its service disabled),
#                       registrations, then the files, the venv,
#                       the CRIU it provided, the state and marks directories
#   --keep-criu         with --uninstall: keep the CRIU --with-criu provided
#   -h, --help
# Exit codes: 0 done; 1 failed; 2 bad arguments or refused (nothing changed).
# CUDAHOOK_ROOT=DIR stands in for "/" for every node path (a whole node in a
# directory; its proc/1/comm says whether systemd runs it); CUDAHOOK_PYTHON picks the Python; CUDAHOOK_PROVISION_CRIU names
# the script --with-criu runs (default scripts/provision-criu.sh).
set -euo pipefail

SRC=$(cd "$(dirname "$0")" && pwd)
ROOT=${CUDAHOOK_ROOT:-}
ROOT=${ROOT%/}
PREFIX=$ROOT/opt/cudahook
RUNTIMES=()
DEFAULT_RT=""
AGENT=""
CRIU_REG=()
WITH_CRIU=0
FORCE=""
KEEP_CRIU=""
DEV=0
DRY=""
UNINSTALL=0
PY=${CUDAHOOK_PYTHON:-/usr/bin/python3}
PROVISION=${CUDAHOOK_PROVISION_CRIU:-$SRC/scripts/provision-criu.sh}

die() { echo "install.sh: $*" >&2; exit 1; }
usage() { echo "install.sh: $*" >&2; exit 2; }
say() { echo "==> $*"; }

while (($#)); do
    case $1 in
        --prefix) [[ $# -ge 2 ]] || usage "--prefix needs a directory"; PREFIX=$2; shift 2 ;;
        --prefix=*) PREFIX=${1#*=}; shift ;;
        --runtime) [[ $# -ge 2 ]] || usage "--runtime needs a name"; RUNTIMES+=("$2"); shift 2 ;;
        --runtime=*) RUNTIMES+=("${1#*=}"); shift ;;
        --default-runtime) DEFAULT_RT=--default-runtime; shift ;;
        --criu-registration) [[ $# -ge 2 ]] || usage "--criu-registration needs global or gpu-only"
            CRIU_REG=(--criu-registration "$2"); shift 2 ;;
        --criu-registration=*) CRIU_REG=(--criu-registration "${1#*=}"); shift ;;
        --with-criu) WITH_CRIU=1; shift ;;
        --agent) AGENT=--agent; shift ;;
        --force) FORCE=--force; shift ;;
        --keep-criu) KEEP_CRIU=--keep-criu; shift ;;
        --dev) DEV=1; shift ;;
        --dry-run) DRY=--dry-run; shift ;;
        --uninstall) UNINSTALL=1; shift ;;
        -h|--help) sed -n '2,42p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) usage "unknown option: $1 (see --help)" ;;
    esac
done
[[ $PREFIX == /* ]] || usage "--prefix must be an absolute path: $PREFIX"
PREFIX=${PREFIX%/}
for rt in "${RUNTIMES[@]}"; do
    case $rt in runc|containerd|docker|podman|crio) ;; *) usage "unknown runtime: $rt" ;; esac
done
case ${CRIU_REG[1]-global} in global|gpu-only) ;; *) usage "unknown CRIU registration: ${CRIU_REG[1]}" ;; esac
[[ -n $KEEP_CRIU && $UNINSTALL -eq 0 ]] && usage "--keep-criu goes with --uninstall"
# A node in a directory (CUDAHOOK_ROOT) needs no root; the real node does.
[[ -n $ROOT || $(id -u) -eq 0 ]] || die "run as root: the hooks and /etc/criu/runc.conf are root's"

"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null \
    || die "need Python >= 3.11 at $PY (set CUDAHOOK_PYTHON)"

installer() {  # the journaled file changes, with whichever Python is there
    local py=$PY
    [[ -x $PREFIX/venv/bin/python ]] && py=$PREFIX/venv/bin/python
    PYTHONPATH=$SRC "$py" -I -c 'import sys; sys.path.insert(0, sys.argv.pop(1)); from cudahook.admin.installer import main; sys.exit(main())' "$SRC" "$@" --prefix "$PREFIX" ${ROOT:+--root "$ROOT"}
}

if ((UNINSTALL)); then
    say "uninstalling cudahook from $PREFIX"
    installer uninstall $DRY $KEEP_CRIU
    exit $?
fi

# Refuse before anything changes when another prefix holds an installation.
installer check $FORCE || exit $?
if ! "$PY" -c 'import venv, ensurepip' 2>/dev/null; then
    [[ -n $DRY ]] && say "would install python3-venv" || {
        say "installing python3-venv"
        command -v apt-get >/dev/null || die "python3-venv missing and no apt-get to install it"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
    }
fi

# What this run creates in the prefix is cudahook's: --uninstall removes it.
owns=()
if [[ -z $DRY && ! -d $PREFIX ]]; then mkdir -p "$PREFIX"; touch "$PREFIX/.installed-by-cudahook"; fi

criuargs=()
if ((WITH_CRIU)); then
    if [[ -n $DRY ]]; then say "would provide CRIU >= 4.0 in $PREFIX/criu"
    else
        say "providing CRIU >= 4.0 in $PREFIX/criu"
        [[ -e $PREFIX/criu ]] || owns+=(--owns "$PREFIX/criu")
        bash "$PROVISION" --prefix "$PREFIX/criu" --link "" || die "providing CRIU failed"
        criuargs=(--criu-link "$PREFIX/criu/bin/criu")
    fi
elif ! command -v criu >/dev/null; then
    echo "install.sh: warning: no criu on PATH; use --with-criu for a working CRIU >= 4.0" >&2
fi

if [[ -n $DRY ]]; then
    say "would create $PREFIX/venv and install cudahook from $SRC"
else
    say "installing cudahook into $PREFIX/venv"
    if [[ ! -x $PREFIX/venv/bin/python ]]; then
        [[ -e $PREFIX/venv ]] || owns+=(--owns "$PREFIX/venv")
        "$PY" -m venv "$PREFIX/venv" || die "cannot create $PREFIX/venv"
    fi
    extra=""; ((DEV)) && extra="[test]"
    "$PREFIX/venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade "$SRC$extra" \
        || die "pip install failed"
fi
rtargs=()
for rt in "${RUNTIMES[@]}"; do rtargs+=(--runtime "$rt"); done
installer install --python "$PREFIX/venv/bin/python" --source "$SRC" \
    "${rtargs[@]}" "${owns[@]}" "${criuargs[@]}" "${CRIU_REG[@]}" $DEFAULT_RT $AGENT $DRY $FORCE || exit $?
[[ -n $DRY ]] || say "done: run 'cudahook doctor' to check the node"
