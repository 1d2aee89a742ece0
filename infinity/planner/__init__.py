"""The planner: a model and a machine in, the tiers, sizes and predicted memory out.

Pure (no torch, no I/O beyond reading /proc and a config): ``plan.py`` derives the sizes the
engine uses at start (``derive_sizes``) and what ``infinity plan`` prints (``plan_memory``);
``inputs.py`` describes the model and the hardware it plans for."""
