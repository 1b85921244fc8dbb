"""The benchmark: prompt sets, rows side by side, reports, and the host-overhead check."""
