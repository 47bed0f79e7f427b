"""Analysis: functions of the event table (breakdowns, op work and roofline, collectives, communication
bandwidth, timeline; launch queues, idle intervals and copy bandwidth over time in ``queues``) and the
StepMetrics summary of a trace."""
