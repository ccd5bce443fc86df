"""`pdgate bench`: a load generator for OpenAI-compatible endpoints, in vLLM `bench serve`'s
dialect, that reports goodput under SLOs (see docs/placement.md).

Modules, one job each: `arrivals` (when), `dataset` and `trace` (what), `client` (one timed
request), `runner` (one load level), `metrics` (the numbers), `report` (the printout), `plots`,
`cli` (the command); `calibrate` (`--calibrate`: service times measured through pdgate) and
`calibrate_fit` (their fitting, pure).
"""

from .cli import build_parser, main

__all__ = ["build_parser", "main"]
