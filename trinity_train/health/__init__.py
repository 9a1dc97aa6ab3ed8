"""Rank health: the per-rank hang watchdog (`watchdog`, DESIGN §12), the limit of each phase
(`limits`), the heartbeats that say which rank is behind (`heartbeat`), what a hung rank leaves
behind (`hang`), and which errors of a run are a lost peer rather than a bug (`lost_peer`); the
per-rank statistics (`rank_stats`) and the straggler rule (`straggler`, DESIGN §8 "Rank
statistics and stragglers").

Nothing is imported here, so that `lost_peer` (which the CLI uses) loads without torch."""
