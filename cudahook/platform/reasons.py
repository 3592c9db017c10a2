"""Reason codes: why a checkpoint or a restore cannot go ahead, defined once.

Every refusal of `cudahook check`, of pre-dump and of post-restore names one
of these codes. A code is stable (scripts, alerts and the metrics' `reason`
label match on it); its text says what is wrong and its hint what to do.

`exit` is what a hook exits with when it refuses for this reason (CRIU and
the runtime only see that); `cudahook check` reduces every problem to 1
("cannot, now") or 6 ("never on this node: start cold or go elsewhere").
"""

from __future__ import annotations

from .criu import INSTALL_HINT, MIN_VERSION, version_text
from .errors import Exit
from .record import Record


class Reason(Record, frozen=True):
    code: str
    side: str  # "checkpoint", "restore" or "both"
    exit: Exit  # what a hook refusing for this reason exits with
    text: str  # one line: what is wrong
    hint: str  # one line: what to do about it
    # A refusal for this reason is remembered per image manifest and node
    # (flow/checks: the restore verdict cache): it is never here (exit 6)
    # and about the node, not the image's bytes, which a copy can mend.
    cacheable: bool = False

    @property
    def never_here(self) -> bool:
        """No retry on this node can change it (exit 6)."""
        return self.exit == Exit.NOT_HERE


_ALL = [
    # -- the driver and its checkpoint support ---------------------------------
    Reason("DRIVER_UNKNOWN", "both", Exit.ENVIRONMENT,
           "the NVIDIA driver version cannot be read",
           "install or load the NVIDIA driver; check driver_version_file and nvidia_smi"),
    Reason("DRIVER_TOO_OLD", "both", Exit.ENVIRONMENT,
           "the driver's checkpoint support lacks what this container needs",
           "upgrade the driver (R550 toggle, R555 actions, R580 device map, R590 launch jobs)"),
    Reason("CHECKPOINT_TOOL_MISSING", "both", Exit.ENVIRONMENT,
           "cuda-checkpoint is not installed and the driver API is not in use",
           "install the NVIDIA driver R550+ (it ships cuda-checkpoint) or set cuda_checkpoint"),
    Reason("PERSISTENCE_OFF", "both", Exit.ENVIRONMENT,
           "persistence mode is off on a GPU the container uses",
           "nvidia-smi -pm 1, or run nvidia-persistenced"),
    Reason("GPU_QUERY_FAILED", "both", Exit.ENVIRONMENT,
           "nvidia-smi cannot list the GPUs",
           "check the driver with nvidia-smi"),
    # -- the container's CUDA processes ----------------------------------------
    Reason("CONTAINER_PAUSED", "checkpoint", Exit.FAILED,
           "the container is paused (cgroup frozen): its CUDA state cannot be read",
           "resume it to check it; a runtime that pauses it for the checkpoint is handled"),
    Reason("PROCESS_STOPPED", "checkpoint", Exit.FAILED,
           "a process of the container is stopped or traced: cuda-checkpoint would hang",
           "send it SIGCONT, or detach the debugger or tracer"),
    Reason("PROCESS_UNREADABLE", "checkpoint", Exit.FAILED,
           "a process's CUDA state cannot be read",
           "see the message; is the process stuck, or its GPU in error?"),
    Reason("PROCESS_FAILED", "checkpoint", Exit.FAILED,
           "a CUDA process is in the driver's failed state",
           "the process's CUDA context is lost: restart the workload"),
    Reason("PROCESS_LOCKED", "checkpoint", Exit.FAILED,
           "a CUDA process is locked by someone else (a checkpoint in progress or abandoned)",
           "wait for it, or unlock it: cuda-checkpoint --action unlock --pid PID"),
    Reason("PROCESS_CHECKPOINTED", "checkpoint", Exit.FAILED,
           "a CUDA process is already checkpointed (off its GPU)",
           "restore it first: cudahook restore --pid PID"),
    Reason("PROCESS_BUSY", "checkpoint", Exit.FAILED,
           "a CUDA process is in an unknown or transient checkpoint state",
           "wait and check again"),
    Reason("NVML_FDS", "checkpoint", Exit.FAILED,
           "a process holds NVIDIA device files that a CUDA checkpoint does not release "
           "(NVML): CRIU cannot dump them",
           "stop the NVML monitor in the container, or close its NVML handles (nvmlShutdown)"),
    # -- the CUDA VMM interposer -------------------------------------------------
    Reason("VMM_SOCKETS_INCOMPLETE", "checkpoint", Exit.FAILED,
           "the CUDA VMM interposer runs in some CUDA processes without its socket",
           "start every CUDA process with the interposer, each with its "
           "/snapshot-control/cuda-vmm-<pid>.sock"),
    Reason("VMM_COORDINATOR_MISSING", "both", Exit.ENVIRONMENT,
           "the CUDA VMM coordinator is not installed or not executable",
           "install it, or set vmm_coordinator in the configuration"),
    # -- CRIU --------------------------------------------------------------------
    Reason("CRIU_MISSING", "checkpoint", Exit.ENVIRONMENT,
           "CRIU is not installed",
           INSTALL_HINT),
    Reason("CRIU_TOO_OLD", "checkpoint", Exit.ENVIRONMENT,
           f"CRIU is older than {version_text(MIN_VERSION)}",
           INSTALL_HINT),
    Reason("CRIU_CUDA_PLUGIN", "both", Exit.ENVIRONMENT,
           "CRIU's own CUDA plugin is installed and would act on the same processes",
           "remove it (or the criu-cuda package), or stop using cudahook on this node"),
    # -- room ----------------------------------------------------------------------
    Reason("HOST_MEMORY", "checkpoint", Exit.FAILED,
           "not enough host memory for the GPU memory a checkpoint copies into the processes",
           "free host memory, raise the container's memory limit, or shrink the GPU working set"),
    Reason("GPU_STORAGE_UNAVAILABLE", "both", Exit.ENVIRONMENT,
           "GPU memory in storage is asked for (or the image holds it) and the driver "
           "cannot give it",
           "a CUDA 13.4+ driver with the driver-API backend, or gpu_memory: host (or auto)"),
    Reason("IMAGE_SPACE", "checkpoint", Exit.FAILED,
           "not enough free space for the checkpoint image",
           "free space in the image directory, or checkpoint elsewhere"),
    # -- the image, at restore -----------------------------------------------------
    Reason("MANIFEST_UNREADABLE", "restore", Exit.NOT_HERE,
           "the image's cudahook manifest is unreadable or of an unknown version",
           "restore it with the cudahook that took it, or start the workload cold"),
    Reason("MANIFEST_NO_DRIVER", "restore", Exit.ENVIRONMENT,
           "the manifest does not record the driver the checkpoint was taken with",
           "the driver branch cannot be checked: take the checkpoint again"),
    Reason("IMAGE_FILE_MISSING", "restore", Exit.NOT_HERE,
           "a file the manifest names is missing from the image",
           "copy the whole image directory, or start the workload cold"),
    Reason("IMAGE_CHECKSUM", "restore", Exit.NOT_HERE,
           "a file of the image does not match the checksum in the manifest",
           "copy the image again from its source, or start the workload cold"),
    Reason("DRIVER_BRANCH", "restore", Exit.NOT_HERE,
           "the checkpoint was taken with another driver branch",
           "restore on a node with the same driver branch, or start the workload cold", cacheable=True),
    Reason("GPU_MISSING", "restore", Exit.NOT_HERE,
           "a GPU the restore needs is not on this node",
           "restore on a node with those GPUs, or give a device map", cacheable=True),
    Reason("GPU_MISMATCH", "restore", Exit.NOT_HERE,
           "this node's GPUs differ in count, model or memory from the checkpoint's",
           "restore on a node with the same GPU model and at least as much memory", cacheable=True),
    Reason("DEVICE_MAP_UNSUPPORTED", "restore", Exit.NOT_HERE,
           "the restore moves GPUs but this driver cannot remap (R580 or newer needed)",
           "restore onto the same GPUs, or on a node with driver R580+", cacheable=True),
    Reason("DEVICE_MAP_INVALID", "restore", Exit.ENVIRONMENT,
           "the device map given does not cover every GPU of the checkpoint",
           "name every GPU of the checkpoint in cudahook.io/device-map"),
]

REASONS: dict[str, Reason] = {r.code: r for r in _ALL}


def get(code: str) -> Reason:
    return REASONS[code]
