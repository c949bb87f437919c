"""prefixmesh load tester: replay Mooncake traces or synthetic workloads against a router or a
replica over gRPC streaming, and report latency, throughput, goodput and prefix-cache hit rates.

Torch-free: the load tester must not compete with the replicas it measures for CPU or memory.
Pipeline: workload (``trace``, ``synthetic``) -> arrival schedule (``arrivals``) -> ``runner``
(sends through a ``client``) -> ``results`` -> ``summary`` -> ``report`` / ``plots``.
"""
