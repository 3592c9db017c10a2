"""The checkpoint core: what to do to a container's CUDA processes, in order.

Owns: finding CUDA processes (`discovery`), locking, checkpointing, restoring
and unlocking them with rollback (`engine`), how each call is made
(`backends`), the GPU device map (`devicemap`), the GPUs of the node (`gpus`),
the checkpoint manifest (`manifest`) and the per-process timeline
(`timeline`).

May import: `cudahook.platform`. Never the hook adapters, the admin tools or
the simulator.
"""
