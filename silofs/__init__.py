"""silofs: a per-node read-only FUSE cache for cloud buckets (the SiloD data manager)."""

__version__ = "0.1.0"
