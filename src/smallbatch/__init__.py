"""smallbatch: do contrastive learners really need large batches?

``smallbatch.results(tracking_uri, experiment=None)``: a study's runs as a pandas DataFrame
(:func:`smallbatch.report.runs.results`); loaded on first use, so ``import smallbatch`` stays light.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "results":
        from .report.runs import results

        return results
    raise AttributeError(f"module 'smallbatch' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), "results"])
