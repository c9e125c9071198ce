"""The correlated-Gaussian mutual-information benchmark (:mod:`.toy`): the contrastive bounds
against the analytic MI, no I/O (its workflow step is :mod:`smallbatch.pipeline.mi_job`)."""
