"""The lower layers keep to their own objects (DESIGN.md "Layers").

checkpoint/ takes a typed training state from the engine, never the engine; zero/ calls the
layers above only through the Protocols and callables it defines. Both read no private
(``_``-prefixed) attribute of another package's object, which is what coupled them to the
engine before (``engine._check_open``, ``engine._load_failure = ...``). The import-linter
contract in pyproject.toml checks the imports; this checks the attribute accesses, which no
import shows.

The rule, per module under infinity/checkpoint and infinity/zero: an access to an attribute
``_name`` (not a dunder), written ``x._name`` or ``getattr/setattr/hasattr/delattr(x, "_name")``,
is allowed only when

- ``x`` is ``self`` or ``cls`` (an object reading its own state), or
- ``_name`` is defined in the same module: a class there binds it in its body or assigns
  ``self._name`` / ``cls._name`` (another instance of the module's own class, as in ``__eq__``;
  a module-local class's private helper), or
- ``_name`` is one of the FOREIGN_PRIVATES below: privates of torch, the standard library or
  transformers that the code must use, each with the reason there is no public way. An
  exception no module uses any more fails too, so the list does not rot.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import infinity

PACKAGE = Path(infinity.__file__).parent
CHECKED = ("checkpoint", "zero")
ATTRIBUTE_CALLS = ("getattr", "setattr", "hasattr", "delattr")
# packages above checkpoint and zero in the layers contract (pyproject.toml)
ABOVE = ("infinity.engine", "infinity.train", "infinity.commands", "infinity.cli")

FOREIGN_PRIVATES = {
    "_version": "torch's tensor version counter, bumped by every in-place change: the only way "
                "to tell that a saved activation or a fetched parameter was modified in place "
                "(autograd checks saved tensors the same way)",
    "_forward_hooks": "nn.Module's forward hook dict: the release hook is moved behind hooks "
                      "registered after it (torch offers prepend= at registration only)",
    "_forward_pre_hooks": "nn.Module's forward pre-hook dict: the fetch hook is kept ahead of "
                          "pre-hooks registered after it (as above)",
    "_C": "torch._C: the autograd engine's state below (no public module exposes it)",
    "_reset_parameters": "nn.MultiheadAttention's and nn.Transformer's initialisation (they "
                         "have no public reset_parameters): run again under zero.Init after "
                         "their children's, as their constructors ran it",
    "_execution_engine": "torch.autograd.Variable._execution_engine.queue_callback: the end of "
                         "a backward pass is run once the whole graph finished (FSDP and "
                         "DeepSpeed do the same; there is no public API)",
    "_current_graph_task_id": "torch._C._current_graph_task_id(): whether this thread runs an "
                              "autograd backward now (-1 outside); no public API says so",
    "_load_from_state_dict": "nn.Module._load_from_state_dict: each module's part of a state "
                             "dict load; patched while a model is prepared (from_pretrained's "
                             "prepare_model) so a load into meta parameters (PEFT's saved "
                             "adapter) keeps its values; no public hook sees the tensors a "
                             "module's load copies into its own parameters",
    "_base": "torch.Tensor._base: the tensor a view views; an in-place op on a unit's view "
             "output replaces the view's autograd node, so its pre-backward hook goes on the "
             "base too (and an input's base counts as passed through); no public API gives it",
    "_sequence_nr": "torch.autograd.graph.Node._sequence_nr(): the order autograd made a node "
                    "in, which tells a call's own nodes from those made before it (walking "
                    "a call's graph for the inputs it read); no public API gives it",
    "_parameters": "nn.Module's parameter dict: a parameter is replaced in place without "
                   "__setattr__ (tied weights stay tied; FSDP2 does the same), and a "
                   "registration is looked up before it is replaced",
    "_buffers": "nn.Module's buffer dict: with _non_persistent_buffers_set, the buffers that "
                "state_dict() saves (torch has no public accessor for persistence)",
    "_non_persistent_buffers_set": "see _buffers",
    "_apply": "nn.Module._apply, wrapped while a prepare_model runs: every move of a module "
              "(.to('meta'), .cuda(), .half()) goes through it, and it is the one place to see "
              "a parameter replaced by its meta copy (PEFT moves its adapter so); no hook "
              "reports a parameter's move",
    "_getframe": "sys._getframe: whether a load (from_pretrained, load_state_dict) is on the "
                 "stack when a parameter is replaced (inspect.stack() is far slower)",
    "_autograd": "torch._C._autograd: see _top_saved_tensors_default_hooks",
    "_top_saved_tensors_default_hooks": "which saved-tensor hooks are on top now: whether a "
                                        "module call's saves reach the engine's hooks (no "
                                        "public API says which hooks are active)",
    "_cdata": "torch.UntypedStorage._cdata: a storage's identity, the same while it is resized "
              "(a unit's flat buffer released and fetched again), where data_ptr() changes; "
              "torch has no public identity for a storage",
    "_init_weights": "transformers' PreTrainedModel._init_weights: the per-module initializer "
                     "its post_init() applies, run on each materialized unit (no public name)",
}


def _modules() -> list[Path]:
    return sorted(p for package in CHECKED for p in (PACKAGE / package).rglob("*.py"))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_names(tree: ast.Module) -> set[str]:
    """Attribute names the module's own classes define: bound in a class body, or assigned on
    ``self``/``cls`` in any function of the module."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(item.name)
                elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                    targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                    names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            names.add(node.attr)
    return names


def _accesses(tree: ast.Module):
    """(line, object expression, attribute) of every private attribute access."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            yield node.lineno, node.value, node.attr
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ATTRIBUTE_CALLS and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str) and _private(node.args[1].value):
            yield node.lineno, node.args[0], node.args[1].value


def private_accesses(source: str) -> tuple[list[str], set[str]]:
    """The accesses ``source`` breaks the rule with, and the FOREIGN_PRIVATES it uses."""
    tree = ast.parse(source)
    own = _own_names(tree)
    broken, used = [], set()
    for line, obj, attr in _accesses(tree):
        if isinstance(obj, ast.Name) and obj.id in ("self", "cls") or attr in own:
            continue
        if attr in FOREIGN_PRIVATES:
            used.add(attr)
            continue
        broken.append(f"line {line}: {ast.unparse(obj)}.{attr}")
    return broken, used


def test_the_rule_flags_a_foreign_private_and_passes_own_ones():
    broken, _ = private_accesses(
        "class A:\n"
        "    def __init__(self):\n        self._mine = 1\n"
        "    def __eq__(self, other):\n        return self._mine == other._mine\n"
        "def f(engine, a):\n"
        "    engine._load_failure = None\n"
        "    getattr(engine, '_closed', False)\n"
        "    return a._mine, engine.__class__, engine.module._buffers\n")
    assert broken == ["line 7: engine._load_failure", "line 8: engine._closed"]


def test_checkpoint_and_zero_read_no_private_attribute_of_another_package():
    broken, used = [], set()
    for path in _modules():
        found, uses = private_accesses(path.read_text())
        broken += [f"{path.relative_to(PACKAGE.parent)} {b}" for b in found]
        used |= uses
    assert not broken, (
        "private attributes of another package's objects read or written (hand the value over "
        "in the training state or through a Protocol/callable the package defines, or, for a "
        "torch private with no public way, add it to FOREIGN_PRIVATES with the reason):\n  "
        + "\n  ".join(broken))
    stale = sorted(set(FOREIGN_PRIVATES) - used)
    assert not stale, f"FOREIGN_PRIVATES no module uses any more (remove them): {stale}"


@pytest.mark.parametrize("package", CHECKED)
def test_no_import_from_the_layers_above(package):
    """Type-checking imports included: the contract is on the code, not on its run time."""
    found = []
    for path in sorted((PACKAGE / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            found += [f"{path.name}:{node.lineno} {n}" for n in names
                      if any(n == above or n.startswith(above + ".") for above in ABOVE)]
    assert not found, f"infinity.{package} imports from the layers above it: {found}"


MAX_MODULE_LINES = 600   # issue 24: a module past this is two concepts; split it by concept


def test_no_module_over_600_lines():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in sorted(PACKAGE.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, (f"modules over {MAX_MODULE_LINES} lines (move a concept into a module of "
                      f"its own; a shim or a denser style is not the fix): {long}")
