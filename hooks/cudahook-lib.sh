# cudahook's shell fast paths, one definition for the three hook executables
# (sourced by the templates in hooks/, copied into each installed hook by
# cudahook.admin.hookfiles). Each test answers "no" (status 1) only when it is
# certain that Python would answer "no" as well; anything it cannot decide -
# an odd file type, a size past the cap, an escape, an unusual character -
# answers "maybe" (status 0), and Python decides.

# Python's caps (cudahook.hooks.oci_state.MAX_STATE, cudahook.flow.oci_bundle.MAX_CONFIG):
# beyond them, Python refuses.
CUDAHOOK_MAX_STATE=1048576
CUDAHOOK_MAX_CONFIG=4194304
# The shell reads fields only from a state this small; a larger one goes to Python.
CUDAHOOK_FAST_STATE=65536
# Where the action script reads processes and cgroups; tests point them at
# a tree of their own (read only when set).
CUDAHOOK_PROC=${CUDAHOOK_PROC_ROOT:-/proc}
CUDAHOOK_CGROUP=${CUDAHOOK_CGROUP_ROOT:-/sys/fs/cgroup}

# May the bundle's config.json ($1/config.json) make a GPU container, or
# carry cudahook's annotations? Python (cudahook.flow.oci_bundle) answers "yes"
# only for files holding one of its GPU_MARKERS in their raw text; a \u or
# \/ escape could spell one in disguise. Not a regular file (a symlink, a
# FIFO, a directory, a device) or larger than the cap: Python's to refuse.
config_may_want_gpu() {
    _f=$1/config.json
    case $_f in /*) ;; *) _f=./$_f ;; esac
    # find only lstat()s: it neither follows a link nor opens a FIFO.
    [ -n "$(find "$_f" -maxdepth 0 -type f -size -$((CUDAHOOK_MAX_CONFIG + 1))c 2>/dev/null)" ] \
        || return 0
    # -D/-d skip: a file swapped for a FIFO or device since is not opened.
    LC_ALL=C grep -q -a -F -D skip -d skip -e '\u' -e '\/' \
        -e NVIDIA_VISIBLE_DEVICES -e /dev/nvidia -e nvidia.com/gpu -e cudahook.io/ -- "$_f"
    [ $? -ne 1 ]  # 1: read it all, no marker; 0 (a marker) or 2 (an error): maybe
}

# The top-level string field $2 of the JSON object in $1, into $v; status 1
# when the shell cannot be sure (Python then reads it): a backslash anywhere
# (an escape could spell or hide the key), anything but printable ASCII and
# JSON's whitespace, the key twice (JSON's last one wins) or inside a nested
# object or a string, or a prefix too long to scan cheaply.
json_field() {
    v=
    case $1 in *\\*) return 1 ;; esac
    case $1 in *[![:print:]"$_ws"]*) return 1 ;; esac
    case $1 in *\"$2\"*\"$2\"*) return 1 ;; esac
    _p=${1%%\"$2\"*}
    [ "$_p" != "$1" ] && [ ${#_p} -le 1024 ] || return 1
    _p=${_p#"${_p%%[!$_ws]*}"}  # leading whitespace
    case $_p in \{*) _p=${_p#\{} ;; *) return 1 ;; esac
    case $_p in *[][{}]*) return 1 ;; esac  # nothing nested before the key
    _n=0  # with no backslash every quote opens or closes a string
    while :; do
        case $_p in *\"*) _p=${_p#*\"}; _n=$((_n + 1)) ;; *) break ;; esac
    done
    [ $((_n % 2)) -eq 0 ] || return 1
    _p=${1#*\"$2\"}
    _p=${_p#"${_p%%[!$_ws]*}"}
    case $_p in :*) _p=${_p#:} ;; *) return 1 ;; esac
    _p=${_p#"${_p%%[!$_ws]*}"}
    case $_p in \"*) _p=${_p#\"} ;; *) return 1 ;; esac
    case $_p in *\"*) ;; *) return 1 ;; esac
    v=${_p%%\"*}
    case $v in *[![:print:]]*) v=; return 1 ;; esac  # JSON strings hold no raw controls
}
# JSON's whitespace as the shell can write it: space, tab, newline (the
# default IFS). A carriage return is left to Python.
_ws=$IFS

# Does the configuration leave device_pattern at its default (which matches
# only /dev/nvidia* paths, as may_hold_gpu does)? A file that names the key,
# or holds a backslash (a YAML escape could spell it), is Python's to read.
device_pattern_is_default() {
    _c=${CUDAHOOK_CONFIG:-${CUDAHOOK_ROOT-}/etc/cudahook/config.yaml}
    [ -e "$_c" ] || [ -h "$_c" ] || return 0
    [ -f "$_c" ] || return 1
    # Builtins only: a grep would cost a fork and an exec at every pre-dump
    # of every container. The file is root's own and short; one longer than
    # the cap is Python's to read. A line that starts with "#" is a YAML
    # comment, which can name no key.
    _n=0
    while IFS= read -r _l || [ -n "$_l" ]; do
        _n=$((_n + 1))
        [ $_n -lt 400 ] && [ ${#_l} -lt 4096 ] || return 1
        case ${_l#"${_l%%[![:space:]]*}"} in "#"*) continue ;; esac  # a comment line
        case $_l in *device_pattern*|*\\*) return 1 ;; esac
    done < "$_c"
}

# May a process of the container whose init is $1 hold an NVIDIA device
# node open? The container's cgroup lists its processes, and each open fd is
# compared with the device nodes as that process sees them (bind-mounted or
# created in the container alike). Python (cudahook.core.discovery) counts fds
# whose path matches device_pattern: with the default (see above) that is a
# /dev/nvidia* node. Anything unusual answers "maybe".
may_hold_gpu() {
    _cg=
    [ -r "$CUDAHOOK_PROC/$1/cgroup" ] || return 0
    while IFS=: read -r _n _ctl _path; do
        case $_ctl in
            pids) _cg=$CUDAHOOK_CGROUP/pids$_path; break ;;
            "") for _b in "$CUDAHOOK_CGROUP/unified" "$CUDAHOOK_CGROUP"; do
                    [ -e "$_b$_path/cgroup.procs" ] && { _cg=$_b$_path; break; }
                done ;;
        esac
    done < "$CUDAHOOK_PROC/$1/cgroup"
    case $_cg in ""|*/) return 0 ;; esac  # the root cgroup: not a container
    for _d in "$_cg"/*/; do [ -d "$_d" ] && return 0; done  # nested cgroups
    [ -r "$_cg/cgroup.procs" ] || return 0
    _seen= _init=$1
    while read -r _pid; do
        [ "$_pid" = "$_init" ] && _seen=1
        # The device nodes as this process sees them, listed once (not once
        # per fd): with none - a pattern that matched nothing names no
        # file - none of its fds can be one.
        set -- "$CUDAHOOK_PROC/$_pid"/root/dev/nvidia*
        [ -e "$1" ] || [ -h "$1" ] || continue
        for _fd in "$CUDAHOOK_PROC/$_pid"/fd/*; do
            for _dev; do
                [ "$_fd" -ef "$_dev" ] && return 0
            done
        done
    done < "$_cg/cgroup.procs"
    [ -z "$_seen" ]  # init not in that cgroup: do not trust it
}
