#!/usr/bin/env bash
# The one command to run on a machine with an NVIDIA GPU, from the repo root:
#
#     bash tests/gpu/run_on_device.sh
#
# It finds python3 (with PyTorch or CuPy) and a real cuda-checkpoint, prints
# the versions, records what the real tool does (tests/gpu/record_evidence.py)
# and then runs the real-GPU tests. Everything lands in $OUT (default
# /tmp/cudahook-gpu-out), flat, six files: run.log, evidence.json, evidence.md,
# pytest.log, pytest-record.jsonl, compare.log.
#
# Time: 8.5 minutes at the very most (EVIDENCE_BUDGET_S + 60 for the recorder,
# custom-storage edges included; PYTEST_TIMEOUT_S for the tests;
# COMPARE_TIMEOUT_S for the simulator against the recorded edges; EVIDENCE_ARGS
# adds recorder options). Exit status: 3 when no cuda-checkpoint or no GPU,
# else pytest's status, else the recorder's (1 if any step failed); in --sim
# mode, else the comparison's.
#
# cuda-checkpoint is looked for in $CUDAHOOK_REAL_CUDA_CHECKPOINT, on PATH, in
# the driver's usual folders, and in .gpu-carry/ (a copy of NVIDIA's public
# bin/x86_64_Linux/cuda-checkpoint carried in with the working tree).
#
# `--sim` runs the same flow on the project's simulated GPU node instead (no
# GPU needed): a dry run of this script, the recorder and the tests.
set -uo pipefail
SIM=0
[[ ${1:-} == --sim ]] && SIM=1
cd "$(dirname "$0")/../.." || exit 3
OUT=${OUT:-${TMPDIR:-/tmp}/cudahook-gpu-out}
mkdir -p "$OUT"
EVIDENCE_BUDGET_S=${EVIDENCE_BUDGET_S:-240}
PYTEST_TIMEOUT_S=${PYTEST_TIMEOUT_S:-150}
COMPARE_TIMEOUT_S=${COMPARE_TIMEOUT_S:-60}
COMPARE=tests/gpu/test_storage_evidence.py

is_elf() { [[ -f $1 && "$(head -c 4 "$1" | od -An -c | tr -d ' \n')" == '177ELF' ]]; }

find_python() {
    local c
    for c in "${PYTHON:-}" /opt/torch/.venv/bin/python3 python3; do
        [[ -n $c ]] || continue
        c=$(command -v "$c" 2>/dev/null) || continue
        if "$c" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            echo "$c"
            return 0
        fi
    done
    return 1
}

find_cuda_checkpoint() {
    local c
    for c in "${CUDAHOOK_REAL_CUDA_CHECKPOINT:-}" "$(command -v cuda-checkpoint 2>/dev/null)" \
        /usr/bin/cuda-checkpoint /usr/local/bin/cuda-checkpoint /usr/local/nvidia/bin/cuda-checkpoint \
        /usr/local/cuda/bin/cuda-checkpoint .gpu-carry/cuda-checkpoint \
        .gpu-carry/bin/x86_64_Linux/cuda-checkpoint; do
        [[ -n $c ]] || continue
        if ! is_elf "$c"; then
            echo "  $c: absent or not a native binary" >&2
            continue
        fi
        if [[ ! -x $c ]]; then
            # A carried copy can lose its mode bits on the way: run a copy.
            install -m 0755 "$c" /tmp/cuda-checkpoint && c=/tmp/cuda-checkpoint
        fi
        realpath "$c"
        return 0
    done
    return 1
}

run_sim() {
    local py=${PYTHON:-python3}
    export PYTHONPATH=. PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
    echo "== record_evidence on the simulator"
    timeout -k 10 $((EVIDENCE_BUDGET_S + 60)) "$py" tests/gpu/record_evidence.py --no-gpu-workloads \
        --out "$OUT" --budget-s "$EVIDENCE_BUDGET_S"
    local ev=$?
    echo "(record_evidence exit $ev)"
    echo "== pytest tests/gpu on the simulator"
    CUDAHOOK_GPU_TEST_SIM=1 CUDAHOOK_GPU_RECORD=$OUT/pytest-record.jsonl \
        CUDAHOOK_GPU_EVIDENCE=$OUT/sim-evidence.json timeout -k 10 "$PYTEST_TIMEOUT_S" \
        "$py" -m pytest tests/gpu -x -q -rfEs -p no:cacheprovider --ignore="$COMPARE" 2>&1 \
        | tee "$OUT/pytest.log"
    local pt=${PIPESTATUS[0]}
    echo "(pytest exit $pt)"
    compare_edges "$py" "$OUT/sim-evidence.json"
    local cm=$?
    if ((pt != 0)); then return "$pt"; fi
    if ((ev != 0)); then return "$ev"; fi
    return "$cm"
}

# The simulator held to the recorded custom-storage edges (needs a C compiler
# for the simulator's libcuda; skipped without one: compare here afterwards
# with CUDAHOOK_GPU_EVIDENCE=evidence.json pytest tests/gpu/test_storage_evidence.py).
compare_edges() {
    echo "== compare: the simulator against the recorded custom-storage edges ($2)"
    CUDAHOOK_GPU_EVIDENCE=$2 timeout -k 10 "$COMPARE_TIMEOUT_S" \
        "$1" -m pytest "$COMPARE" -q -rfEs -p no:cacheprovider 2>&1 | tee "$OUT/compare.log"
    local rc=${PIPESTATUS[0]}
    echo "(compare exit $rc)"
    return "$rc"
}

main() {
    echo "== run_on_device: $(date -u +%FT%TZ) in $PWD, OUT=$OUT"
    if ((SIM)); then
        run_sim
        return
    fi
    echo "== host"
    uname -a
    cat /proc/driver/nvidia/version 2>/dev/null || echo "(no /proc/driver/nvidia/version)"
    find /usr/local/nvidia/bin -maxdepth 1 -printf '%f ' 2>/dev/null; echo
    echo "== nvidia-smi"
    if ! timeout 60 nvidia-smi --query-gpu=index,uuid,name,memory.total,driver_version,persistence_mode \
        --format=csv,noheader,nounits; then
        echo "run_on_device: nvidia-smi failed: no usable NVIDIA GPU here" >&2
        return 3
    fi
    timeout 30 nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits

    echo "== python"
    local py
    if ! py=$(find_python); then
        echo "run_on_device: no python3 >= 3.11 found (set PYTHON)" >&2
        return 3
    fi
    echo "$py"
    timeout 120 "$py" - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0])
for name in ("torch", "cupy", "pynvml", "pytest", "yaml", "jsonschema"):
    try:
        mod = importlib.import_module(name)
        print(f"{name} {getattr(mod, '__version__', '?')}")
    except Exception as exc:
        print(f"{name}: not importable ({type(exc).__name__})")
try:
    import torch
    print("torch cuda", torch.version.cuda, "available", torch.cuda.is_available())
except Exception:
    pass
EOF

    echo "== cuda-checkpoint"
    local cc
    if ! cc=$(find_cuda_checkpoint); then
        echo "run_on_device: no real cuda-checkpoint found. It ships with some drivers; otherwise" >&2
        echo "  copy NVIDIA's public bin/x86_64_Linux/cuda-checkpoint (github.com/NVIDIA/cuda-checkpoint)" >&2
        echo "  to .gpu-carry/cuda-checkpoint in the working tree, or set CUDAHOOK_REAL_CUDA_CHECKPOINT." >&2
        timeout 30 find /usr /opt -name 'cuda-checkpoint*' -type f 2>/dev/null | head -5
        return 3
    fi
    echo "$cc ($(sha256sum "$cc" | cut -c1-16)...)"
    # NVIDIA's published binary is a small stub over the driver's libcuda.so.1
    # (the driver supplies the features and the help text): make sure it loads.
    if ldd "$cc" 2>/dev/null | grep -q 'libcuda.so.1 => not found'; then
        local d
        for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu /usr/lib64; do
            if [[ -e $d/libcuda.so.1 ]]; then
                export LD_LIBRARY_PATH=$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
                echo "libcuda.so.1 from $d"
                break
            fi
        done
    fi
    timeout 60 "$cc" --help; echo "(--help exit $?)"

    if compgen -G ".gpu-carry/runc*.deb" >/dev/null || compgen -G ".gpu-carry/criu*" >/dev/null; then
        echo "note: runc/CRIU found in .gpu-carry/: checkpointing a CUDA *container* with runc is a"
        echo "      follow-up; this run checks the per-process engine only."
    fi

    export CUDAHOOK_REAL_CUDA_CHECKPOINT=$cc CUDAHOOK_GPU_PYTHON=$py PYTHONUNBUFFERED=1
    export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
    export PYTHONDONTWRITEBYTECODE=1

    echo "== record_evidence (budget ${EVIDENCE_BUDGET_S}s)"
    local extra=()
    read -r -a extra <<<"${EVIDENCE_ARGS:-}"  # e.g. EVIDENCE_ARGS="--sizes 1,2"
    timeout -k 10 $((EVIDENCE_BUDGET_S + 60)) "$py" tests/gpu/record_evidence.py --out "$OUT" \
        --cuda-checkpoint "$cc" --budget-s "$EVIDENCE_BUDGET_S" "${extra[@]}"
    local ev=$?
    echo "(record_evidence exit $ev)"

    echo "== pytest tests/gpu (timeout ${PYTEST_TIMEOUT_S}s)"
    CUDAHOOK_GPU_RECORD=$OUT/pytest-record.jsonl CUDAHOOK_GPU_EVIDENCE=$OUT/evidence.json \
        timeout -k 10 "$PYTEST_TIMEOUT_S" \
        "$py" -m pytest tests/gpu -x -q -rfEs -p no:cacheprovider --ignore="$COMPARE" 2>&1 \
        | tee "$OUT/pytest.log"
    local pt=${PIPESTATUS[0]}
    echo "(pytest exit $pt)"
    # A difference is a finding for the simulator, not a failure of this run.
    compare_edges "$py" "$OUT/evidence.json"

    echo "== left behind (should be empty)"
    pgrep -af 'tests/gpu/workloads.py' || true
    ls -la "$OUT"
    if ((pt != 0)); then return "$pt"; fi
    return "$ev"
}

main 2>&1 | tee "$OUT/run.log"
exit "${PIPESTATUS[0]}"
