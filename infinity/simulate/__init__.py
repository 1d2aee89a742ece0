"""The byte-free backend: the engine's parts on a simulated clock.

``infinity plan --dry-run`` (commands/dry_run.py) builds the engine's own units, pools and
coordinator with the engine's assembly, over this backend instead of real bytes: the tier
manager, its stores, the device memory cache and the slot pools holding meta tensors
(``storage``), the host <-> device copies (``copies``), the collectives (``collectives``) and
the optimizer's step schedule (``stepper``), each on the lanes of one simulated clock
(``clock``). Each class implements the interface of the layer it stands in for (storage's,
comm's, zero's Protocols), which is why this package sits beside the engine, above optim: it
imports the layers it simulates, and nothing imports it but the commands.
"""
