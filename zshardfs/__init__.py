"""zshardfs: a FUSE view of sharded array stores as their unsharded equivalent."""

__version__ = "0.1.0"
