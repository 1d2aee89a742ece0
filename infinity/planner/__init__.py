"""The planner: a model and a machine in, the tiers, sizes and predicted memory out; the one
place sizes are computed (the engine and the optimizer ask it).

Pure (no torch, no storage, no I/O beyond reading /proc and a config), one concept a module:

* ``inputs.py``: the model (element counts per unit) and the hardware it plans for;
* ``tiers.py``: the tier vocabulary (``Tier``), re-used by storage;
* ``alignment.py``: O_DIRECT and per-parameter padding, the flat layout of a unit;
* ``placement.py``: where each kind of state lives, and its bytes there;
* ``sizes.py``: every "auto" size derived from the budgets (``derive_sizes``);
* ``engine_sizes.py``: the engine's own sizes from those and the built units' counts, and the
  optimizer's slot and chunk counts;
* ``plan.py``: predicted memory per tier with warnings (``plan_memory``), the shallowest config
  that fits; ``render.py``: the plan as a table for people.
"""
