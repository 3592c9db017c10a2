"""A faithful stand-in for an NVIDIA GPU, its driver's checkpoint support and
the tools around it, so that every part of cudahook runs for real without a GPU.

- `gpu`: the GPU service (a daemon on a Unix socket) that owns device memory.
- `runtime`: the CUDA runtime inside a workload: its restore thread, locks,
  checkpoint (device memory copied into the process) and restore.
- `workload`: a CUDA program that computes, checks its memory and reports.
- `tool`: a drop-in `cuda-checkpoint` (CLI, outputs, errors by driver version).
- `smi`: a drop-in `nvidia-smi` for the queries cudahook makes.
- `lab`: sets all of that up in one directory.
"""
