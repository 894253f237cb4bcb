"""One Prometheus exposition from several: the API's registry and every rank's text.

Ranks export the same families (``cuda_graph_passes`` ...) with different ``group``/``rank``/
``role`` labels; concatenating their texts would repeat each family's ``# HELP``/``# TYPE``,
which Prometheus rejects. Here every text is parsed, samples are merged by family (the first
source's help and type win; a family whose type disagrees with it is dropped, with a warning)
and the union is written once.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)


class _Merged:
    """A collector of already merged families (what :func:`generate_latest` reads)."""

    def __init__(self) -> None:
        self.families: dict[str, Metric] = {}
        self._seen: set[tuple] = set()

    def add(self, family: Metric) -> None:
        have = self.families.get(family.name)
        if have is None:
            have = self.families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
        elif have.type != family.type:
            log.warning("metric %s: type %s differs from %s seen first; dropped", family.name, family.type, have.type)
            return
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            if key not in self._seen:  # the same series twice (cannot happen with distinct rank labels)
                self._seen.add(key)
                have.samples.append(s)

    def collect(self) -> Iterable[Metric]:
        return list(self.families.values())


def merge_expositions(registry, texts: Iterable[bytes | str]) -> bytes:
    """``registry``'s metrics and those of every Prometheus ``texts``, one ``# HELP``/``# TYPE`` per family."""
    merged = _Merged()
    # The registry goes through the parser too: parsed, a histogram's ``_created`` series is a
    # family of its own, as in the ranks' texts; collected directly it sits inside the histogram,
    # and a family both ways would be declared twice.
    for text in (generate_latest(registry), *texts):
        for family in text_string_to_metric_families(text.decode() if isinstance(text, bytes) else text):
            merged.add(family)
    return generate_latest(merged)
