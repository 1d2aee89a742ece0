"""infinity.zero: units, the stage-3 coordinator, prefetch, zero.Init, GatheredParameters and
register_external_parameter."""
from infinity.zero.init import GatheredParameters, Init, register_external_parameter

__all__ = ["Init", "GatheredParameters", "register_external_parameter"]
