#!/bin/sh
# PROTOTYPE (benchmark evidence only, not installed anywhere): a CRIU action
# script that decides in the shell, with builtins only, that a container has
# no GPU work, and starts Python only when it may have.
# @PYTHON@, @CONFIG@ and @STATE@ are filled in by bench/p1_noop_action.py.
PYTHON=@PYTHON@
CUDAHOOK_CONFIG=@CONFIG@; export CUDAHOOK_CONFIG
STATE=@STATE@
DEVS="/dev/nvidiactl /dev/nvidia-uvm /dev/nvidia-uvm-tools /dev/nvidia[0-9]*"

gpu() { exec "$PYTHON" -I -c 'import sys; from cudahook.hooks.criu_action import main; sys.exit(main())'; }

# Does any process of the init's own cgroup hold an NVIDIA device node open?
# Only shell builtins: `read`, globbing and `test -ef` (same device+inode).
holds_gpu() {
    cg=
    while IFS=: read -r _n ctl path; do
        case "$ctl" in pids|"") cg=$path; [ "$ctl" = pids ] && base=/sys/fs/cgroup/pids || base=/sys/fs/cgroup/unified ;; esac
        [ "$ctl" = pids ] && break
    done < "/proc/$1/cgroup"
    # Not in a container cgroup: cannot scope cheaply, let Python decide.
    case "$cg" in ""|/) return 0 ;; esac
    while read -r pid; do
        for fd in /proc/"$pid"/fd/*; do
            for dev in $DEVS; do
                [ "$fd" -ef "$dev" ] && return 0
            done
        done
    done < "$base$cg/cgroup.procs"
    return 1
}

case "$CRTOOLS_SCRIPT_ACTION" in
    pre-dump)
        # The OCI hook recorded this init as a GPU container: Python.
        [ -e "$STATE/pids/$CRTOOLS_INIT_PID" ] && gpu
        holds_gpu "$CRTOOLS_INIT_PID" && gpu
        exit 0 ;;
    post-restore)
        [ -e "$CRTOOLS_IMAGE_DIR/cudahook-manifest.json" ] && gpu
        exit 0 ;;
    post-resume)
        # post-restore (same CRIU, our parent) kept a run record only for CUDA images.
        for f in "$STATE/runs/$PPID"-*.json; do [ -e "$f" ] && gpu; done
        [ -e "$CRTOOLS_IMAGE_DIR/cudahook-manifest.json" ] && gpu
        exit 0 ;;
    *) exit 0 ;;
esac
