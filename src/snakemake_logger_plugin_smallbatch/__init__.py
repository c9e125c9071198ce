"""Snakemake's logger plugin for a smallbatch study: ``snakemake --logger smallbatch`` prints one line
per finished cell with its time and an ETA (:mod:`smallbatch.local.console`) instead of Snakemake's
rule blocks; Snakemake's full log stays in ``.snakemake/log/``.  Snakemake finds it by this package's
name (``snakemake_logger_plugin_<name>``)."""

from smallbatch.local.console import console_handler_class

LogHandler = console_handler_class()

__all__ = ["LogHandler"]
