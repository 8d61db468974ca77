"""Starting a cluster on one machine: `nori up`, its process launcher, the CPU plan and the private
redis-server it starts when no Redis is reachable."""
