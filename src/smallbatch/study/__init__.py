"""The study as configured, without torch: the config and its schema, the cells and their checks,
the registries of probes and side experiments, and the batch-size rules of the optimiser's knobs."""
