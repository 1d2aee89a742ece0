"""The byte-free backend: the engine's parts on a simulated clock.

``infinity plan --dry-run`` (commands/dry_run.py) builds the engine's own units, pools and
coordinator with the engine's assembly (engine/assembly.py) over this backend instead of real
bytes: the tier manager, its stores, the device memory cache and the slot pools holding meta
tensors (``storage``), the host <-> device copies (``copies``), the collectives
(``collectives``), the optimizer's step schedule (``stepper``) and the training thread's
compute (``compute``), each on the lanes of one simulated clock (``clock``); ``backend`` is
what the assembly asks of a backend (``engine.assembly.PartsBackend``).

Why a package of its own, beside the engine: each class stands in for a part of a lower layer
(storage's Protocols, comm's ``Collectives``, zero's ``UnitStepper``), so it imports the layers
it simulates; none of it is a command, and the engine, which it must not drift from, never
imports it (the import contract in pyproject.toml keeps both rules). In the package only the
commands import it.
"""
