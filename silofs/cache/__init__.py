"""The LMDB chunk cache: on-disk format (format.py) and the store (store.py)."""
