"""The study's plumbing: the CLI every workflow rule calls (:mod:`.cli`), its jobs
(:mod:`.jobs`, :mod:`.mi_job`), the config and its schema, the cells, the warm-start server,
adopted evaluations, exports and the allocator setting."""
