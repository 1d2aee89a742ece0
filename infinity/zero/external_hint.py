"""The hint stage-3 forward and backward errors get when a module may have read a parameter of
another module (released: 0 elements) without ``register_external_parameter``, and the note a
dtype mismatch gets at any stage (the engine cast every parameter to the compute dtype). Torch's and
transformers' own messages ("got [0]", an IndexError) never name the cause; the engine turns the
empty-tensor ones into an error that does and adds a note to the others (not to infinity's
own errors)."""
from __future__ import annotations

import re
from pathlib import Path


EXTERNAL_PARAMETER_HINT = (
    "stage 3 fetches a unit only around the forward of the unit's root module (a transformer "
    "block, say; released parameters have 0 elements). If a module's forward uses another module's parameter (e.g. F.linear(x, "
    "self.embed.weight) or a penalty on a child's weight in a parent module), declare it with "
    "infinity.zero.register_external_parameter(module, parameter). If a parent calls a "
    "submodule of a block directly, not through the block (self.blocks[0].mlp(h); Reformer's "
    "reversible layers), make that submodule's class a unit of its own with "
    "\"infinity\": {\"unit_modules\": [\"ClassName\", ...]}. A loss term computed outside "
    "every forward (a weight penalty in the training loop) reads released parameters too: "
    "compute it in a module's forward, or run the forward, that term and the backward inside "
    "infinity.zero.GatheredParameters([those parameters])")


DTYPE_HINT = (
    "infinity: every parameter is kept in the engine's compute dtype (infinity.compute_dtype; "
    "\"auto\": on a CPU-only machine bf16 where the CPU has native bf16, else fp32; on a GPU from "
    "bf16/fp16.enabled), whatever dtype the model was "
    "built in: a forward that casts its inputs to a submodule's own dtype, or is fed inputs of "
    "another float dtype, meets the compute dtype instead")
# torch's messages for operands of two float dtypes
_DTYPE_MISMATCH = re.compile(r"same dtype|dtype .* but got|expected .*(dtype|scalar type)"
                             r"|Input type .* and weight type", re.IGNORECASE)


def raise_with_external_parameter_hint(exc: BaseException, where: str, stage: int) -> None:
    """A forward or backward failed. Two float dtypes met (a cast to a submodule's own dtype,
    inputs of another dtype): at any stage, add the compute-dtype note, since the engine cast
    every parameter. At stage 3, when torch's message is about a 0-element tensor, raise a
    RuntimeError that says how to declare an external parameter; for other errors of the kinds
    such a read causes (an IndexError in transformers' code, say), add the hint as a note and
    let the caller re-raise the error as it is."""
    if not isinstance(exc, (RuntimeError, IndexError, ValueError)) or \
            _raised_by_infinity(exc) or \
            any(note.startswith("infinity:") for note in getattr(exc, "__notes__", ())):
        return      # infinity's own error, or one it explained already
    if stage == 3 and isinstance(exc, RuntimeError) and _mentions_empty_tensor(str(exc)):
        raise RuntimeError(f"the {where} failed ({str(exc).splitlines()[0][:200]}), probably "
                           f"on a parameter whose unit was not fetched: "
                           f"{EXTERNAL_PARAMETER_HINT}") from exc
    if not hasattr(exc, "add_note"):
        return
    if _DTYPE_MISMATCH.search(str(exc)):
        exc.add_note(DTYPE_HINT)
    elif stage == 3:
        exc.add_note(f"infinity: if this {where} read a parameter of a module other than "
                     f"the one running, {EXTERNAL_PARAMETER_HINT}")


def _raised_by_infinity(exc: BaseException) -> bool:
    """Whether the innermost frame of ``exc`` is infinity's own code (its optimizer refusing a
    hyperparameter, say): such an error is not about a parameter read outside its module."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(_PACKAGE_DIR)


_PACKAGE_DIR = Path(__file__).resolve().parent.parent     # infinity/


def _mentions_empty_tensor(message: str) -> bool:
    """Whether a torch error message is about a 0-element or 0-byte tensor (a released
    parameter): "storage of size 0", "shape [0]", "vec (0)", "got 0"..."""
    return "storage of size 0" in message or re.search(
        r"\[0\]|\(0\)|\bsize 0\b|\bgot 0\b|must be \d-D", message) is not None
