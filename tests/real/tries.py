"""Best-of-N real-engine tests: each try's verdict, and the agreement rate reported."""

from __future__ import annotations

import pytest

#: The user property a best-of-N test's agreement is recorded under.
AGREEMENT = "agreement"


class Tries:
    """The tries of a best-of-N test and whether each agreed, reported with the test.

    Why: a real engine on a busy machine sometimes answers in a way the proxy cannot time
    (its API server not scheduled while the engine runs), so such a test accepts the
    first (or the best) of N tries. How often tries agree is the signal that the test is
    still meaningful, so it is printed with the test and in the run's summary, and kept
    in the test's report (``user_properties``, in JUnit XML too). A test that stops at
    its first agreement reports how many tries that took."""

    def __init__(self, node: pytest.Item) -> None:
        self.node = node
        self.seen: list[bool] = []

    def saw(self, agreed: bool) -> bool:
        """Record one try's verdict; returns it."""
        self.seen.append(bool(agreed))
        props = [p for p in self.node.user_properties if p[0] != AGREEMENT]
        self.node.user_properties[:] = [*props, (AGREEMENT, self.rate)]
        return agreed

    @property
    def rate(self) -> str:
        n = len(self.seen)
        agreed = sum(self.seen)
        return f"agreed in {agreed} of {n} tries ({agreed / n:.0%})" if n else "no tries"
