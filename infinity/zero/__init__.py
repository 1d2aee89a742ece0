"""infinity.zero"""
