"""Advice: rules over StepMetrics, their gains priced by the estimate, the calibration regression fitted on
measured runs, and verification by re-running."""
