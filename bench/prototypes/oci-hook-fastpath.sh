#!/bin/sh
# PROTOTYPE (benchmark evidence only, not installed anywhere): an OCI hook
# that lets non-GPU containers through without starting Python.
# @PYTHON@, @CONFIG@ and @STATE@ are filled in by the benchmarks.
PYTHON=@PYTHON@
CUDAHOOK_CONFIG=@CONFIG@; export CUDAHOOK_CONFIG
STATE=@STATE@

# runc writes the state as one JSON line without a newline.
IFS= read -r state || :
gpu() {
    printf '%s' "$state" | "$PYTHON" -I -c 'import sys; from cudahook.hooks.oci_hook import main; sys.exit(main(sys.argv[1:]))' "$@"
    exit $?
}
field() { v=${state#*\"$1\":\"}; [ "$v" = "$state" ] && v= ; v=${v%%\"*}; }

case "$1" in
    poststop)
        # Only GPU containers have a record to forget.
        field id
        [ -e "$STATE/containers/$v.json" ] || exit 0
        gpu "$@" ;;
    prestart|createRuntime|createContainer|startContainer)
        field bundle
        [ -r "$v/config.json" ] || gpu "$@"   # let Python report the problem
        # Anything that can make a container a GPU container (or opt it in) -> Python.
        grep -qsF -e NVIDIA_VISIBLE_DEVICES -e /dev/nvidia -e cdi.k8s.io/ -e cudahook.io/ \
            "$v/config.json" || exit 0
        gpu "$@" ;;
    *) gpu "$@" ;;
esac
