"""Cross-site semantic search over per-site embedding exports (SEEC): index, mapping, merge, sim_k."""
