"""Rank health (DESIGN §8 "Rank health"): per-rank statistics and the straggler rule
(`health.rank_stats`, `health.straggler`). Modules are imported by their own names."""
