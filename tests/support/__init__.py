"""The harness the tests and the benchmarks share: real servers, real nodes, polling.

Modules (each imports only the standard library, silofs, and what its servers need):

    poll        wait_for: poll a condition until a deadline (never a sleep as a barrier)
    net         free_port, and network namespaces joined by veth pairs or one bridge,
                links shaped with tc, sockets made inside a namespace (root only)
    servers     moto (S3), s3rver, Azurite, fake-gcs-server as subprocesses on 127.0.0.1,
                and one helper API over every store (create a bucket, put, options)
    node        a private silofs node: daemon subprocess, mounts, logs, a cleanup that
                leaves no mount and no process behind
    trees       datasets as {key: bytes}: seeded random files, patterned files, on disk
    faultproxy  a fault-injecting, latency-adding HTTP proxy in front of a server (TLS on
                either side, in a namespace of this host where asked)
    asuser      run a function as another local user (fork, setuid)
    baseline    another git revision of this repository, unpacked, to run side by side
    slurm       a one-node Slurm cluster (slurmctld, slurmd, munge) with silofs's prolog
                and epilog, its job user and the operator's venv (root only)
    cluster     the certificates and silofs.toml of an N-node cluster (one cache across
                nodes): a CA, node certificates, a stranger's and an old-style one
    netcluster  N nodes, each a host of its own (a namespace on one bridged subnet, a
                shaped link, its own daemon, certificate and mount) reading one store
                through a limited link; epochs read in each node's own order (root only)
    fixtures    the pytest plugin: the above as fixtures (servers, make_node, needs_fuse)

Never: measures anything (bench/ does), asserts a promise of silofs (the tests do), or
talks to a real cloud (every server listens on 127.0.0.1).
"""
