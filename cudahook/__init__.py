"""cudahook: checkpoint and restore GPU containers around NVIDIA cuda-checkpoint."""

__version__ = "0.1.0"
