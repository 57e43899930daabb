"""How the worker writes: at what pace, through which path, with how many threads, on which cores.

- ``throttle``: ``ThrottleConfig``: priority, cores, threads, I/O priority and write rate of the writer.
- ``io_threads``: how many shard files the worker writes at once (``io_threads="auto"``).
- ``cpu_limits``: the CPU set and quota this process's cgroup allows it.
- ``directio``: shard files written with ``O_DIRECT``, bypassing the page cache.
"""
