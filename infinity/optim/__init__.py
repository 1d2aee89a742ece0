"""infinity.optim"""
