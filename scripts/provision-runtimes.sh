#!/usr/bin/env bash
# Install the container engines cudahook's daemon end-to-end tests drive, on a
# Debian 12 (bookworm) host, WITHOUT leaving the system's own daemons running:
#   * containerd 1.6.20 (containerd, ctr, containerd-shim-runc-v2)
#   * docker.io 20.10   (dockerd, docker client in /usr/bin, docker-init=tini)
#   * podman 4.3        (daemonless; its OCI runtime is the system runc: crun
#                        is not pulled in, Debian's crun 1.8 has no checkpoint)
# The tests start private instances (tests/e2e/daemons.py) with their own
# root/state/sockets; a system containerd on /run/containerd/containerd.sock
# or a system dockerd on /var/run/docker.sock is not used and is not wanted.
#
# Usage: provision-runtimes.sh [--force]
#   --force   apt-get install --reinstall even if the packages are present
#
# Runs apt-get with --no-install-recommends under a policy-rc.d that forbids
# service starts; afterwards stops any containerd/dockerd the install started
# anyway and disables the services (systemd units or sysv links). Needs
# runc (scripts/provision-criu.sh installs it with CRIU 4.1.1).
# Idempotent: a second run only verifies. Must run as root.
set -euo pipefail

PKGS=(containerd docker.io podman)
FORCE=0
POLICY=/usr/sbin/policy-rc.d
POLICY_OURS=0
APT_LOG=

log() { printf 'provision-runtimes: %s\n' "$*"; }
die() { printf 'provision-runtimes: ERROR: %s\n' "$*" >&2; exit 1; }
usage() { sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; }

while (($#)); do
    case $1 in
        --force) FORCE=1; shift ;;
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
log "done in $((SECONDS - START))s"
