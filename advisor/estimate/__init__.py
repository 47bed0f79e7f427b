"""Estimate: memory per GPU and step time from specs alone, the achievable-rate model under it, the layout
planner and the published runs it is checked on. Pure arithmetic, no torch, no I/O beyond its own data files."""
