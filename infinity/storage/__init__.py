"""infinity.storage"""
from infinity.storage.extents import Extent, ExtentAllocator
from infinity.storage.integrity import PageFingerprints, SwapCorruptionError
from infinity.storage.preflight import SwapPathError, check_swap_path
from infinity.storage.swap import SwapSpace
from infinity.storage.swap_dir import NotOursError, OwnerAliveError, SwapDir, reclaim, reclaim_stale

__all__ = ["Extent", "ExtentAllocator", "SwapPathError", "check_swap_path", "SwapSpace", "SwapDir",
           "NotOursError", "OwnerAliveError", "reclaim", "reclaim_stale", "SwapCorruptionError",
           "PageFingerprints"]
