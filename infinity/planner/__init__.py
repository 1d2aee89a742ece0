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

For a machine described instead of detected (``infinity plan --gpus ...``, issue 27):

* ``target.py``: GPU presets, the target cluster (``Target``) and the workload (``Workload``);
* ``shape.py``: a transformer's widths and depth, its activations and FLOPs per token;
* ``rank_memory.py``: one rank's device, host and NVMe bytes for a config, by the engine's own
  ``engine_sizes``, and whether the node holds its ranks;
* ``decide.py``: the decision path, stage 0 -> ZeRO-1/2/3 -> CPU -> NVMe, or what to add;
* ``step_time.py``: the step's traffic per link, the bottleneck, the predicted step;
* ``target_plan.py``: the three together with notes and JSON; ``explain.py``: as text.

For this (CPU-only) machine, measured: ``calibration.py``, the step time and peak host memory of
a run from rates measured here, and the constants fitted to measured runs
(tools/bench/plan_calibration.py). The metadata-only dry run of the engine's own schedule is
above the engine, in ``infinity.commands.dry_run``.
"""
