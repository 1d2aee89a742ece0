"""infinity.storage"""
