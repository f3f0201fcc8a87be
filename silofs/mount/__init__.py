"""The mount side: one process per mount, a pyfuse3 frontend that serves hits from the
shared LMDB env and sends misses to the node daemon over the control socket.

Import rule: nothing here imports silofs/node/ (the daemon's side); a mount process
loads only this package and the shared modules. tests/unit/test_layout.py checks it.
"""
