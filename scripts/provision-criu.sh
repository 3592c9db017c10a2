#!/usr/bin/env bash
# Provision what cudahook's end-to-end tests need on a Debian 12 (bookworm) host:
#   * from bookworm: runc, busybox-static, iptables, iproute2, python3
#   * CRIU 4.1.1 from Debian 13 (trixie), unpacked (never installed) into a
#     private prefix together with trixie's libc6 and every library it needs,
#     run through the prefix's own ld-linux (bookworm's criu 3.17 fails on
#     recent kernels: "vdso: Unexpected rt vDSO area bounds").
#
# Usage: provision-criu.sh [--prefix DIR] [--link DIR] [--force]
#   --prefix DIR  private CRIU prefix (default /opt/cudahook/criu)
#   --link DIR    where to put the `criu` symlink runc finds on PATH
#                 (default /usr/local/sbin; "" = no symlink)
#   --force       re-download and re-unpack CRIU even if it already works
#
# Idempotent: a second run only verifies. Must run as root.
set -euo pipefail

PREFIX=/opt/cudahook/criu
LINK_DIR=/usr/local/sbin
FORCE=0
SUITE=trixie
PIN_PRIORITY=100
SOURCES_FILE=/etc/apt/sources.list.d/cudahook-trixie.sources
PIN_FILE=/etc/apt/preferences.d/cudahook-trixie
BASE_PKGS=(runc busybox-static iptables iproute2 python3)
MIN_MAJOR=4

log() { printf 'provision-criu: %s\n' "$*"; }
die() { printf 'provision-criu: ERROR: %s\n' "$*" >&2; exit 1; }

usage() { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; }

while (($#)); do
    case $1 in
        --prefix) [[ $# -ge 2 ]] || die "--prefix needs a directory"; PREFIX=$2; shift 2 ;;
        --prefix=*) PREFIX=${1#*=}; shift ;;
        --link) [[ $# -ge 2 ]] || die "--link needs a directory"; LINK_DIR=$2; shift 2 ;;
        --link=*) LINK_DIR=${1#*=}; shift ;;
        --force) FORCE=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown argument: $1 (see --help)" ;;
    esac
done

[[ $PREFIX == /* ]] || die "--prefix must be an absolute path: $PREFIX"
[[ -z $LINK_DIR || $LINK_DIR == /* ]] || die "--link must be an absolute path: $LINK_DIR"
PREFIX=${PREFIX%/}
[[ $(id -u) -eq 0 ]] || die "must run as root"
command -v apt-get >/dev/null || die "apt-get not found: this script needs Debian"
[[ $(dpkg --print-architecture) == amd64 ]] || die "only amd64 is supported (got $(dpkg --print-architecture))"

export DEBIAN_FRONTEND=noninteractive
WRAPPER=$PREFIX/bin/criu
ROOT=$PREFIX/root
LOADER=$ROOT/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2
START=$SECONDS

# ---------------------------------------------------------------- bookworm packages
missing_pkgs() {
    local p st
    for p in "$@"; do
        st=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)
        [[ $st == installed ]] || printf '%s\n' "$p"
    done
}

mapfile -t MISSING < <(missing_pkgs "${BASE_PKGS[@]}")
if ((${#MISSING[@]})); then
    log "installing from bookworm: ${MISSING[*]}"
    apt-get update -qq || die "apt-get update failed"
    apt-get install -y -qq --no-install-recommends "${MISSING[@]}" >/dev/null \
        || die "apt-get install ${MISSING[*]} failed"
else
    log "bookworm packages present: ${BASE_PKGS[*]}"
fi
command -v runc >/dev/null || die "runc not on PATH after install"
[[ -x /bin/busybox ]] || die "/bin/busybox missing after installing busybox-static"

# ---------------------------------------------------------------- CRIU check
criu_ok() {
    # true when the wrapper runs, reports version >= MIN_MAJOR and `criu check` passes
    [[ -x $WRAPPER ]] || return 1
    local v major
    v=$("$WRAPPER" --version 2>/dev/null | sed -n 's/^Version: *//p' | head -n1)
    major=${v%%.*}
    [[ $major =~ ^[0-9]+$ ]] && ((major >= MIN_MAJOR)) || return 1
    "$WRAPPER" check 2>&1 | grep -q 'Looks good'
}

write_apt_source() {
    local want src
    src=/etc/apt/sources.list.d/debian.sources
    # Copy the URI/keyring of the existing bookworm entry (mirror or snapshot).
    local uris="http://deb.debian.org/debian"
    local signed="/usr/share/keyrings/debian-archive-keyring.gpg"
    if [[ -f $src ]]; then
        local u s
        u=$(awk 'BEGIN{RS=""} /Suites:[^\n]*bookworm([ \n]|$)/ && !/security/ {
                 match($0, /URIs:[^\n]*/); print substr($0, RSTART+5, RLENGTH-5); exit}' "$src" | xargs || true)
        s=$(awk 'BEGIN{RS=""} /Suites:[^\n]*bookworm([ \n]|$)/ && !/security/ {
                 if (match($0, /Signed-By:[^\n]*/)) print substr($0, RSTART+10, RLENGTH-10); exit}' "$src" | xargs || true)
        [[ -n $u ]] && uris=$u
        [[ -n $s && -f ${s%% *} ]] && signed=$s
    fi
    want=$(printf 'Types: deb\nURIs: %s\nSuites: %s\nComponents: main\nSigned-By: %s\n' \
        "$uris" "$SUITE" "$signed")
    if [[ ! -f $SOURCES_FILE || $(cat "$SOURCES_FILE") != "$want" ]]; then
        log "adding apt source $SOURCES_FILE ($uris $SUITE)"
        printf '%s\n' "$want" >"$SOURCES_FILE"
    fi
    want=$(printf '# cudahook provision-criu.sh: %s is only for apt-get download + dpkg -x\n' "$SUITE"
           printf 'Package: *\nPin: release n=%s\nPin-Priority: %s\n' "$SUITE" "$PIN_PRIORITY")
    if [[ ! -f $PIN_FILE || $(cat "$PIN_FILE") != "$want" ]]; then
        log "pinning $SUITE at priority $PIN_PRIORITY ($PIN_FILE)"
        printf '%s\n' "$want" >"$PIN_FILE"
    fi
}

# Print package $1's trixie stanza (first one); fail when trixie has no such package.
suite_stanza() {
    local out
    out=$(apt-cache show "$1/$SUITE" 2>/dev/null) || true
    [[ $out == *"Package: $1"* ]] || return 1
    awk '/^$/{exit} {print}' <<<"$out"
}

# Dependency closure of criu in trixie, following only library packages (lib*).
# One apt-cache call per dependency level (each call takes about a second).
resolve_closure() {
    local -A seen=()
    local -a level=(criu) next
    local out p d
    while ((${#level[@]})); do
        for p in "${level[@]}"; do seen[$p]=1; done
        out=$(apt-cache show "${level[@]/%//$SUITE}" 2>/dev/null) || true
        for p in "${level[@]}"; do
            grep -qx "Package: $p" <<<"$out" || die "package $p not found in $SUITE"
        done
        next=()
        for d in $(awk '/^Package:/ { skip = ($2 in done); done[$2] = 1 }
                        /^(Pre-Depends|Depends):/ && !skip { sub(/^[^:]*:/, ""); print }' <<<"$out" \
                   | tr ',' '\n' | sed -E 's/\|.*//; s/\(.*\)//; s/:any//; s/[[:space:]]//g' \
                   | grep -E '^lib' | sort -u); do
            [[ -n ${seen[$d]:-} ]] || next+=("$d")
        done
        level=("${next[@]}")
    done
    printf '%s\n' "${!seen[@]}" | sort
}

# Libraries of criu that the prefix's loader cannot find inside the prefix.
unresolved_libs() {
    local libpath=$1
    "$LOADER" --library-path "$libpath" --list "$ROOT/usr/sbin/criu" 2>&1 \
        | awk -v root="$ROOT/" '/=>/ {
              if ($0 ~ /not found/) { print $1 " (not found)"; next }
              if (index($3, root) != 1) print $1 " (outside prefix: " $3 ")" }'
}

install_criu() {
    write_apt_source
    if ! suite_stanza criu >/dev/null; then
        log "apt-get update (for $SUITE lists)"
        apt-get update -qq || die "apt-get update failed"
    fi
    suite_stanza criu >/dev/null || die "criu not found in $SUITE after apt-get update"

    local closure
    closure=$(resolve_closure) || die "cannot resolve criu's dependencies in $SUITE"
    local -a pkgs
    mapfile -t pkgs <<<"$closure"
    log "downloading ${#pkgs[@]} $SUITE packages: ${pkgs[*]}"

    local work
    work=$(mktemp -d "${TMPDIR:-/tmp}/provision-criu.XXXXXX")
    # shellcheck disable=SC2064
    trap "rm -rf '$work'" EXIT
    mkdir -p "$work/debs" "$work/root"
    chmod 0755 "$work"
    chown _apt "$work/debs" 2>/dev/null || true   # lets apt download sandboxed
    (cd "$work/debs" && apt-get download -qq "${pkgs[@]/%//$SUITE}" >/dev/null) \
        || die "apt-get download from $SUITE failed"
    local deb
    for deb in "$work"/debs/*.deb; do
        dpkg-deb -x "$deb" "$work/root" || die "dpkg-deb -x $deb failed"
    done
    for deb in "$work"/debs/*.deb; do
        # shellcheck disable=SC2016  # dpkg-deb expands ${Package}, not the shell
        dpkg-deb --show --showformat='${Package} ${Version}\n' "$deb"
    done >"$work/root/PACKAGES"

    # Swap the new tree in atomically-ish (old prefix kept until the new one is in place).
    mkdir -p "$PREFIX"
    rm -rf "$PREFIX/root.new"
    mv "$work/root" "$PREFIX/root.new"
    rm -rf "$ROOT"
    mv "$PREFIX/root.new" "$ROOT"
    cp "$ROOT/PACKAGES" "$PREFIX/PACKAGES"
    rm -rf "$work"
    trap - EXIT
}

lib_dirs() {
    local d
    for d in usr/lib/x86_64-linux-gnu lib/x86_64-linux-gnu usr/lib lib; do
        [[ -d $ROOT/$d ]] && printf '%s\n' "$ROOT/$d"
    done
}

write_wrapper() {
    local -a dirs
    mapfile -t dirs < <(lib_dirs)
    local libpath
    libpath=$(IFS=:; printf '%s' "${dirs[*]}")
    [[ -x $LOADER ]] || die "loader $LOADER missing in prefix"
    [[ -x $ROOT/usr/sbin/criu ]] || die "criu binary missing in prefix"
    local missing
    missing=$(unresolved_libs "$libpath" | paste -sd, -)
    [[ -z $missing ]] || die "criu libraries not provided by the prefix: $missing"
    mkdir -p "$PREFIX/bin"
    cat >"$WRAPPER.tmp" <<EOF
#!/bin/sh
# Generated by cudahook scripts/provision-criu.sh: runs Debian $SUITE's CRIU with
# its own libc from $ROOT. exec keeps every inherited fd (runc: criu swrk 3).
exec "$LOADER" --library-path "$libpath" --argv0 criu "$ROOT/usr/sbin/criu" "\$@"
EOF
    chmod 0755 "$WRAPPER.tmp"
    mv "$WRAPPER.tmp" "$WRAPPER"
}

if ((FORCE == 0)) && criu_ok; then
    log "CRIU in $PREFIX already works; skipping download"
else
    install_criu
    write_wrapper
fi
# Keep the apt source/pin in place (also on the fast path) so apt never
# upgrades to trixie behind our back: priority stays low.
[[ -f $SOURCES_FILE ]] && write_apt_source

if [[ -n $LINK_DIR ]]; then
    mkdir -p "$LINK_DIR"
    if [[ $(readlink "$LINK_DIR/criu" 2>/dev/null || true) != "$WRAPPER" ]]; then
        [[ -e $LINK_DIR/criu && ! -L $LINK_DIR/criu ]] \
            && die "$LINK_DIR/criu exists and is not a symlink; remove it or use --link"
        ln -sfn "$WRAPPER" "$LINK_DIR/criu"
        log "linked $LINK_DIR/criu -> $WRAPPER"
    fi
fi

# ---------------------------------------------------------------- final check
CHECK_OUT=$("$WRAPPER" check 2>&1) || true
grep -q 'Looks good' <<<"$CHECK_OUT" \
    || die "criu check failed: $(grep -v '^Warn' <<<"$CHECK_OUT" | tail -n1)"
VERSION=$("$WRAPPER" --version 2>/dev/null | sed -n 's/^Version: *//p' | head -n1)
MAJOR=${VERSION%%.*}
if ! [[ $MAJOR =~ ^[0-9]+$ ]] || ((MAJOR < MIN_MAJOR)); then
    die "criu version '$VERSION' is older than $MIN_MAJOR.0"
fi
log "criu check: Looks good"
log "criu $VERSION ready: $WRAPPER${LINK_DIR:+ (on PATH as $LINK_DIR/criu)} [$((SECONDS - START))s]"
