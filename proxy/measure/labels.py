"""Label values that come from the wire, bounded in length and characters.

A model id is whatever text the engine lists, and each one becomes a label value on every
histogram's series for that model: a few very long ids would make ``/metrics`` and the
proxy's memory grow with them. Every name an engine lists passes :meth:`LabelBound.fits`
before it can become a label value: at most ``max_label_length`` characters, all printable (no
control characters, no line or paragraph separators). What does not fit is never listed,
so requests for it are labelled ``other`` like any unlisted model; each refusal is
counted and said (the value itself never: its length only).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client import Counter

log = logging.getLogger(__name__)

#: Longest label value taken from the wire (--max-label-length): the longest real model
#: ids (an org, a repo and a GGUF file name) stay well below.
DEFAULT_MAX_LABEL_LENGTH = 128


def plain(value: str, max_label_length: int = DEFAULT_MAX_LABEL_LENGTH) -> bool:
    """Whether `value` may be a label value as it is."""
    return 0 < len(value) <= max_label_length and value.isprintable()


class LabelBound:
    """Decides which wire names may become label values; counts and says the others."""

    def __init__(self, folded: Counter, max_label_length: int = DEFAULT_MAX_LABEL_LENGTH) -> None:
        self.folded = folded
        self.max_label_length = max_label_length
        #: The rate-limited warning (proxy.core.limited.LimitedLog's ``warning``), set by
        #: the app; None: no line.
        self.warn: Callable[..., object] | None = None

    def fits(self, upstream: str, label: str, value: str) -> bool:
        """Whether `value` (of the `label` label, from `upstream`) may be used as it is;
        when not, it is counted under `label` and said once in a while."""
        if plain(value, self.max_label_length):
            return True
        self.folded.labels(upstream, label).inc()
        if self.warn is not None:
            self.warn(
                "label_" + label,
                "upstream %s: a %s name of %d characters is longer than --max-label-length "
                "(%d) or not printable; requests for it are labelled other",
                upstream,
                label,
                len(value),
                self.max_label_length,
            )
        return False
