"""The CUDA VMM interposer step: detecting interposer sockets under
/snapshot-control (`sockets`) and running the coordinator around the
checkpoint and restore (`coordinator`).

May import: `cudahook.core` and `cudahook.platform`.
"""
