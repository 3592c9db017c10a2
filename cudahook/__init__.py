"""cudahook: checkpoint and restore GPU containers around NVIDIA cuda-checkpoint.

The tree is the architecture; data flows one way, top to bottom:

    hooks/     the executables' adapters: OCI hook, CRIU action script, runtime
               wrapper, guardian. They read what a runtime or CRIU hands them.
    vmm/       the CUDA VMM interposer step: sockets and the coordinator.
    core/      the checkpoint core: discovery, the engine, its backends, the
               device map, the manifest, the timeline.
    platform/  the one seam to the outside world: tools, /proc, cgroups, node
               paths, configuration, the state store, the log, errors.
    admin/     the operator's tools: cli, install, configure, doctor, status.
    sim/       the GPU simulator (tests and the demo); product code never
               imports it (the demo command alone runs it).

`tests/test_layout.py` enforces the direction.
"""

__version__ = "0.1.0"
