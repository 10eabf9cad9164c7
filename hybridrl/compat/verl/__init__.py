"""verl's module paths as thin re-exports of hybridrl's classes: a verl agent loop, tool, interaction or
data-preprocessing script runs here when `verl.` becomes `hybridrl.compat.verl.` in its import lines (README.md
here lists the modules and what is not supported)."""
__all__ = ["DataProto"]


def __getattr__(name: str):
    """`from verl import DataProto`: verl's TensorDict-backed DataProto, imported (with tensordict) on first use."""
    if name == "DataProto":
        from hybridrl.compat.verl.protocol import DataProto

        return DataProto
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
