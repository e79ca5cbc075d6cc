"""What a run's data shows, read by comparison and triage: op traces, step 0, layout, data, clipping, kernels."""
