"""silofs-ctl: SiloD's controller side (estimator, policies, simulator, live controller).

Owns everything that decides allocations. Talks to node daemons only through their
control API (silofs.control.client); never imported by the node package silofs/.
"""
