"""The node daemon's side: one process per node that owns the store clients, the
allocations, the limiters, every remote GET and the one LMDB writer.

Import rule: silofs/mount/ never imports anything from here; both sides import only
the shared modules (silofs/cache, silofs/control, records, uri, config, units, errors,
flight, mountinfo). tests/unit/test_layout.py checks it.
"""
