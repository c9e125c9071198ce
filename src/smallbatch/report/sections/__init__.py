"""The report's sections: each a module with ``build(runs, ctx) -> SectionOutput | None``
(listed in :data:`smallbatch.report.SECTIONS`), with the findings and figures they own."""
