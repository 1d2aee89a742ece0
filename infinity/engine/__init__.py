"""The engine: the facade users touch (``infinity.initialize`` returns one), wired from one config.

``engine.py`` builds the parts and runs the training calls; the other modules are its helpers:
``entry`` (``initialize``), ``sizing`` (the sizes it asks the planner for and checks),
``param_groups``, ``passes`` (forward/backward hooks), ``guards``, ``model_methods`` and
``module_state`` (the model's methods routed through the engine), ``deepspeed_api`` (DeepSpeed's
accessors)."""
from infinity.engine.engine import Engine

__all__ = ["Engine"]
