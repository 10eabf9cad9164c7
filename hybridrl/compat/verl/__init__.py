"""verl's module paths as thin re-exports of hybridrl's classes: a verl agent loop, tool, interaction or
data-preprocessing script runs here when `verl.` becomes `hybridrl.compat.verl.` in its import lines (README.md
here lists the modules and what is not supported)."""
from hybridrl.protocol import DataProto

__all__ = ["DataProto"]
