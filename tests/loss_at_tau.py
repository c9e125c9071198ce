"""``at_tau(loss, tau)``: a loss whose every call passes ``temperature=tau`` (losses take τ per
call; most tests fix one τ for a loss, so they build it once with this)."""

from __future__ import annotations


class at_tau:  # noqa: N801 - reads as a function at the call site
    def __init__(self, loss, tau) -> None:
        self.loss, self.tau = loss, tau

    def __call__(self, *args, **kwargs):
        kwargs.setdefault("temperature", self.tau)
        return self.loss(*args, **kwargs)

    def from_scores(self, *args, **kwargs):
        kwargs.setdefault("temperature", self.tau)
        return self.loss.from_scores(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.loss, name)
