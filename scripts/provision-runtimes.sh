#!/usr/bin/env bash
# Install the container engines cudahook's daemon end-to-end tests drive, on a
# Debian 12 (bookworm) host, WITHOUT leaving the system's own daemons running:
#   * containerd 1.6.20 (containerd, ctr, containerd-shim-runc-v2)
#   * docker.io 20.10   (dockerd, docker client in /usr/bin, docker-init=tini)
#   * podman 4.3        (daemonless; its OCI runtime is the system runc: crun
#                        is not pulled in, Debian's crun 1.8 has no checkpoint)
# and, BESIDE those (never installed: `apt-get download` + `dpkg -x` into
# PRIVATE_DIR/<package>-<version>, run on this libc, checked with ldd):
#   * containerd 1.7 and docker.io 26 with docker-cli, from Debian 13 (trixie)
#   * promtool (trixie) and prometheus-node-exporter (bookworm), for the
#     metrics file's checks; no node_exporter service is installed or started
# The tests start private instances (tests/e2e/daemons.py) with their own
# root/state/sockets; a system containerd on /run/containerd/containerd.sock
# or a system dockerd on /var/run/docker.sock is not used and is not wanted.
#
# Usage: provision-runtimes.sh [--force] [--private-dir DIR]
#   --force            apt-get install --reinstall even if the packages are
#                      present; unpack the private ones again
#   --private-dir DIR  where the private runtimes go (default: .cache/runtimes
#                      in the checkout)
#
# Runs apt-get with --no-install-recommends under a policy-rc.d that forbids
# service starts; afterwards stops any containerd/dockerd the install started
# anyway and disables the services (systemd units or sysv links). Needs
# runc (scripts/provision-criu.sh installs it with CRIU 4.1.1, and adds the
# low-pinned trixie apt source the private runtimes come from).
# Idempotent: a second run only verifies. Must run as root.
set -euo pipefail

PKGS=(containerd docker.io podman)
FORCE=0
PRIVATE_DIR=$(cd "$(dirname "$0")/.." && pwd)/.cache/runtimes
# package/suite, unpacked together under PRIVATE_DIR/<name>-<version of the first>
PRIVATE_SETS=(
    "containerd containerd/trixie"
    "docker docker.io/trixie docker-cli/trixie"
    "promtool promtool/trixie"
    "node-exporter prometheus-node-exporter"
)
POLICY=/usr/sbin/policy-rc.d
POLICY_OURS=0
APT_LOG=

log() { printf 'provision-runtimes: %s\n' "$*"; }
die() { printf 'provision-runtimes: ERROR: %s\n' "$*" >&2; exit 1; }
usage() { sed -n '2,28p' "$0" | sed 's/^# \{0,1\}//'; }

while (($#)); do
    case $1 in
        --force) FORCE=1; shift ;;
        --private-dir) [[ $# -ge 2 ]] || die "--private-dir needs a directory"; PRIVATE_DIR=$2; shift 2 ;;
        --private-dir=*) PRIVATE_DIR=${1#*=}; shift ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown argument: $1 (see --help)" ;;
    esac
done

[[ $(id -u) -eq 0 ]] || die "must run as root"
command -v apt-get >/dev/null || die "apt-get not found: this script needs Debian"
export DEBIAN_FRONTEND=noninteractive
START=$SECONDS

cleanup() {
    if ((POLICY_OURS)); then rm -f "$POLICY"; fi
    return 0
}
trap cleanup EXIT

# PIDs of processes whose executable is one of the given paths.
pids_of() {
    local p exe want
    for p in /proc/[0-9]*; do
        exe=$(readlink "$p/exe" 2>/dev/null) || continue
        for want in "$@"; do
            if [[ $exe == "$want" ]]; then printf '%s\n' "${p#/proc/}"; fi
        done
    done
}

DAEMONS=(/usr/bin/containerd /usr/sbin/dockerd /usr/bin/dockerd)

missing_pkgs() {
    local p st
    for p in "$@"; do
        st=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)
        [[ $st == installed ]] || printf '%s\n' "$p"
    done
}

# ---------------------------------------------------------------- install
mapfile -t MISSING < <(missing_pkgs "${PKGS[@]}")
((FORCE)) && MISSING=("${PKGS[@]}")
if ((${#MISSING[@]})); then
    command -v runc >/dev/null || log "note: runc not installed yet; apt will pull bookworm's runc"
    mapfile -t BEFORE < <(pids_of "${DAEMONS[@]}")
    if [[ ! -e $POLICY ]]; then
        printf '#!/bin/sh\n# provision-runtimes.sh: no service starts during install\nexit 101\n' >"$POLICY"
        chmod 0755 "$POLICY"
        POLICY_OURS=1
    elif ! grep -q 'exit 101' "$POLICY"; then
        log "note: existing $POLICY may allow service starts; will stop them afterwards"
    fi
    log "installing: ${MISSING[*]} (--no-install-recommends, service starts blocked)"
    APT_LOG=$(mktemp /tmp/provision-runtimes-apt.XXXXXX.log)
    apt-get update -qq >>"$APT_LOG" 2>&1 || die "apt-get update failed (see $APT_LOG)"
    REINSTALL=()
    ((FORCE)) && REINSTALL=(--reinstall)
    # Candidates are bookworm's: provision-criu.sh's trixie source is pinned low.
    apt-get install -y -qq --no-install-recommends "${REINSTALL[@]}" \
        -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
        "${MISSING[@]}" >>"$APT_LOG" 2>&1 || die "apt-get install ${MISSING[*]} failed (see $APT_LOG)"
    rm -f "$APT_LOG"
    # Anything the install started despite policy-rc.d: stop it, by PID.
    mapfile -t AFTER < <(pids_of "${DAEMONS[@]}")
    for pid in "${AFTER[@]}"; do
        [[ " ${BEFORE[*]} " == *" $pid "* ]] && continue
        log "stopping daemon started by the install: pid $pid ($(readlink "/proc/$pid/exe" 2>/dev/null || echo gone))"
        kill -TERM "$pid" 2>/dev/null || true
    done
else
    log "packages present: ${PKGS[*]}"
fi

# ---------------------------------------------------------------- services off
if [[ -d /run/systemd/system ]]; then
    for unit in docker.socket docker.service containerd.service podman.socket podman.service; do
        if systemctl list-unit-files "$unit" >/dev/null 2>&1; then
            systemctl disable --now "$unit" >/dev/null 2>&1 || log "note: could not disable $unit"
        fi
    done
    log "systemd units docker.socket/docker.service/containerd.service disabled and stopped"
else
    # No systemd as PID 1 (e.g. a Firecracker VM): nothing starts the units;
    # turn the sysv scripts off for a later sysv boot.
    for svc in docker containerd; do
        if [[ -x /etc/init.d/$svc ]] && command -v update-rc.d >/dev/null; then
            update-rc.d "$svc" disable >/dev/null 2>&1 || log "note: update-rc.d $svc disable failed"
        fi
    done
    log "no systemd as PID 1: sysv docker/containerd scripts disabled"
fi

# ---------------------------------------------------------------- verify
for bin in /usr/bin/containerd /usr/bin/ctr /usr/bin/containerd-shim-runc-v2 /usr/sbin/dockerd /usr/bin/docker /usr/bin/podman /usr/bin/conmon; do
    [[ -x $bin ]] || die "$bin missing after install"
done
command -v runc >/dev/null || die "runc not on PATH"
CTRD_V=$(/usr/bin/containerd --version | awk '{print $3}')
DOCKERD_V=$(/usr/sbin/dockerd --version | sed -n 's/^Docker version \([^,]*\),.*/\1/p')
[[ $CTRD_V == 1.6.* ]] || log "warning: containerd $CTRD_V, tests were written against 1.6.20"
[[ $DOCKERD_V == 20.10.* ]] || log "warning: dockerd $DOCKERD_V, tests were written against 20.10"
PODMAN_V=$(/usr/bin/podman --version | awk '{print $3}')
[[ $PODMAN_V == 4.* ]] || log "warning: podman $PODMAN_V, tests were written against 4.3"
log "containerd $CTRD_V, dockerd $DOCKERD_V, podman $PODMAN_V, $(runc --version | head -1)"

running=$(pids_of "${DAEMONS[@]}" | tr '\n' ' ')
[[ -z $running ]] || log "warning: containerd/dockerd processes running (pids: $running) - not started by this run"
which_docker=$(command -v docker || true)
if [[ $which_docker != /usr/bin/docker ]]; then
    log "note: 'docker' on PATH is $which_docker, not docker.io's /usr/bin/docker (the tests use /usr/bin/docker)"
fi

# ---------------------------------------------------------------- private runtimes
# Newer versions beside the packaged ones: each set is unpacked (never
# installed, so no service, user or apt state changes) into its own directory
# named after the first package's upstream version, e.g. containerd-1.7.24.
# A set is done when its .ok stamp names the same package versions.
[[ $PRIVATE_DIR == /* ]] || die "--private-dir must be an absolute path: $PRIVATE_DIR"
mkdir -p "$PRIVATE_DIR"

# "pkg version" of each package/suite as apt would download it now.
candidates() {
    local spec pkg suite v
    for spec in "$@"; do
        pkg=${spec%%/*}
        suite=${spec#"$pkg"}; suite=${suite#/}
        if [[ -n $suite ]]; then
            v=$(apt-cache show "$pkg/$suite" 2>/dev/null | sed -n 's/^Version: //p' | head -n1)
        else
            v=$(apt-cache policy "$pkg" 2>/dev/null | sed -n 's/^ *Candidate: //p' | head -n1)
            [[ $v == "(none)" ]] && v=
        fi
        [[ -n $v ]] || return 1
        printf '%s %s\n' "$pkg" "$v"
    done
}

# Every ELF binary under $1 must find its libraries on this system (ldd).
check_libs() {
    local f bad=
    while IFS= read -r -d '' f; do
        [[ $(head -c4 "$f" 2>/dev/null | od -An -c | tr -d ' ') == 177ELF ]] || continue
        if ldd "$f" 2>&1 | grep -q 'not found\|version .GLIBC_[0-9.]*. not found'; then
            bad+=" ${f#"$1"/}"
        fi
    done < <(find "$1/usr/bin" "$1/usr/sbin" -type f -print0 2>/dev/null)
    [[ -z $bad ]] || die "binaries that do not run on this libc:$bad (ldd)"
}

unpack_set() {
    local name=$1; shift
    local want dir work deb upstream
    if ! want=$(candidates "$@"); then
        log "apt-get update (for ${*})"
        apt-get update -qq || die "apt-get update failed"
        want=$(candidates "$@") || die "no candidate for one of: $* (is the trixie source there? scripts/provision-criu.sh adds it)"
    fi
    upstream=$(head -n1 <<<"$want" | awk '{print $2}')
    upstream=${upstream#*:}; upstream=${upstream%%[~+-]*}
    dir=$PRIVATE_DIR/$name-$upstream
    if ((FORCE == 0)) && [[ -f $dir/.ok && $(cat "$dir/.ok") == "$want" ]]; then
        check_libs "$dir"
        log "$name $upstream present in $dir"
        return 0
    fi
    work=$(mktemp -d "${TMPDIR:-/tmp}/provision-runtimes.XXXXXX")
    chmod 0755 "$work"
    mkdir "$work/debs" "$work/root"
    chown _apt "$work/debs" 2>/dev/null || true   # lets apt download sandboxed
    (cd "$work/debs" && apt-get download -qq "$@" >/dev/null 2>&1) \
        || { rm -rf "$work"; die "apt-get download $* failed"; }
    for deb in "$work"/debs/*.deb; do
        dpkg-deb -x "$deb" "$work/root" || { rm -rf "$work"; die "dpkg-deb -x $deb failed"; }
    done
    # Only the binaries matter here: no init scripts, units or docs to mislead.
    rm -rf "$work/root/etc" "$work/root/lib" "$work/root/usr/lib/systemd" "$work/root/usr/share"
    check_libs "$work/root"
    printf '%s\n' "$want" >"$work/root/.ok"
    rm -rf "$dir.new" "$dir"
    mv "$work/root" "$dir"
    rm -rf "$work"
    # Older unpacked versions of the same set are not used any more.
    local old
    for old in "$PRIVATE_DIR/$name"-*; do
        [[ $old == "$dir" || ! -d $old ]] || rm -rf -- "$old"
    done
    log "$name $upstream unpacked into $dir"
}

for set in "${PRIVATE_SETS[@]}"; do
    # shellcheck disable=SC2086  # a set is a name and its package/suite words
    unpack_set $set
done
"$PRIVATE_DIR"/containerd-*/usr/bin/containerd --version >/dev/null || die "private containerd does not run"
"$PRIVATE_DIR"/docker-*/usr/sbin/dockerd --version >/dev/null || die "private dockerd does not run"
"$PRIVATE_DIR"/docker-*/usr/bin/docker --version >/dev/null || die "private docker client does not run"
"$PRIVATE_DIR"/promtool-*/usr/bin/promtool --version >/dev/null 2>&1 || die "private promtool does not run"
"$PRIVATE_DIR"/node-exporter-*/usr/bin/prometheus-node-exporter --version >/dev/null 2>&1 \
    || die "private node_exporter does not run"
log "private: $(cd "$PRIVATE_DIR" && echo */ | tr -d /)"
log "done in $((SECONDS - START))s"
