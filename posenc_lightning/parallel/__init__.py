"""Context parallelism: a sequence split over ranks (see docs/guides/context-parallel.md)."""
