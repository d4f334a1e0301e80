"""Running engines side by side: tensor-parallel worker processes, data-parallel replicas, and the one supervisor
that starts, watches and stops them."""
