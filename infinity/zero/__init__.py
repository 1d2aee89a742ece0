"""infinity.zero: units, the stage-3 coordinator, prefetch, zero.Init and GatheredParameters."""
from infinity.zero.init import GatheredParameters, Init

__all__ = ["Init", "GatheredParameters"]
