"""Analysis: functions of the event table (breakdowns, op work and roofline, collectives, communication
bandwidth, timeline) and the StepMetrics summary of a trace."""
