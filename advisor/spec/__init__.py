"""Specs: what the user asked for (model, training step, parallelism, hardware, run options), presets and
Hugging Face configs that build them, and the StepMetrics record every later stage reads. Pure, no torch."""
