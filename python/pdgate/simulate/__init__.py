"""`pdgate simulate`: a discrete-event model of colocated, disaggregated and conditional
placement, for sizing a PD fleet before measuring it with `pdgate bench` (docs/placement.md).

Modules: `model` (service times), `placement` (the pluggable decision), `analysis` (worked
example, split threshold, P:D ratio), `workers` and `engine` (the event loop), `traffic`,
`stats`, `results`, `cli`.
"""

from .analysis import pd_ratio, split_threshold, worked_example
from .cli import build_parser, main
from .engine import SimConfig, Simulator
from .model import ServiceModel
from .placement import Decision, PlacementView, conditional

__all__ = sorted(["Decision", "PlacementView", "ServiceModel", "SimConfig", "Simulator", "build_parser",
                  "conditional", "main", "pd_ratio", "split_threshold", "worked_example"])
