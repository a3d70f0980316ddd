"""Reading a server's Prometheus metrics over HTTP, as Prometheus itself would: the one scraper of the tests
and the tools, built on prometheus_client's own text parser."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from mhaserve.testing.loopback import WAIT


@dataclass(frozen=True)
class Sample:
    name: str  # as exposed: mhaserve_requests_total, mhaserve_batch_size_bucket, ...
    labels: Mapping[str, str]
    value: float


class Samples:
    """Every sample of one scrape."""

    def __init__(self, samples: list[Sample]) -> None:
        self.samples = samples

    def __iter__(self) -> Iterator[Sample]:
        return iter(self.samples)

    def get(self, name: str, default: float = 0.0, /, **labels: str) -> float:
        """The sum of the samples named `name` whose labels include `labels` (`default` if there are none)."""
        found = [s.value for s in self.samples if s.name == name and labels.items() <= s.labels.items()]
        return sum(found) if found else default

    def has(self, name: str) -> bool:
        return any(s.name == name for s in self.samples)


def parse(text: str) -> Samples:
    return Samples(
        [
            Sample(s.name, dict(s.labels), float(s.value))
            for family in text_string_to_metric_families(text)
            for s in family.samples
        ]
    )


def from_registry(registry: CollectorRegistry) -> Samples:
    """Every sample of a registry in this process (a server in a thread), without going through HTTP."""
    return Samples([Sample(s.name, dict(s.labels), float(s.value)) for f in registry.collect() for s in f.samples])


def scrape(port: int, host: str = "127.0.0.1", timeout: float = WAIT) -> Samples:
    """GET http://host:port/metrics, parsed."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout) as r:
        return parse(r.read().decode())
