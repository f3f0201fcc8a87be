"""Fixtures that start real storage servers on 127.0.0.1 (filled in by the backends work)."""
