"""infinity.io"""
