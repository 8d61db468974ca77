"""Starting a cluster's processes on one machine: the launcher that runs and supervises the roles
(local_cluster), the CPU plan that pins them, and the private redis-server started when no Redis
is reachable. `nori up` (nori.cli.up) and the benchmarks drive them."""
