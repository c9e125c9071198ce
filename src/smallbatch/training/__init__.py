"""Contrastive pretraining of one cell: the loop (:mod:`.loop`), one optimisation step
(:mod:`.step`), its negatives, temperature, optimiser, gradient caching, ghost batch norm,
data parallelism, health checks and the state/checkpoint files."""
