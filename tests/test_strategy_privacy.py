"""No file of the package asks a data-parallel strategy what it is or reads its private fields.

The checkpoints and the pipeline runner ask the strategy through its interface
(parallel/data/strategy.py: `held_slices`, `compute_copies`, `optimizer_state`, `stage_hooks`); a
file that branches on a strategy's type, or reads a field a strategy keeps to itself, would have to
change with every new variant. The package's source is parsed with `ast` (nothing of it runs but
the import of parallel/data/, which names the classes):

(a) Strategy classes: every class defined in a module of `ndtrain.parallel.data` that is an
    `nn.Module` (wrappers, chunk lists), a `torch.optim.Optimizer` or named `*Strategy` (adapters).
    Outside the file that defines X, no `isinstance(_, X)` / `issubclass(_, X)` (X alone or in a
    tuple) and no `type(_) is X`, `is not`, `==`, `!=` or `in` a tuple holding X.
(b) Private fields: a name `_foo` (one leading underscore, not a dunder) that a class of
    parallel/data/ defines (`self._foo = ...` in its methods, or `_foo` assigned, annotated or
    defined in its body). In any file of the package that defines no `_foo` of its own, no
    attribute access `x._foo` where x is anything but `self` or `cls`.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import ndtrain
import ndtrain.parallel.data

PACKAGE = Path(ndtrain.__file__).resolve().parent
DATA = Path(ndtrain.parallel.data.__file__).resolve().parent
NAMED = {"DistributedDataParallel", "Zero2DataParallel", "FullyShardedDataParallel", "FullyShardedChunks",
         "ZeroOptimizer", "SingleProcessDataParallel", "DDPStrategy", "ZeroStrategy", "FSDPStrategy",
         "DataParallelChunks", "Zero1DataParallel", "FlatAdamW", "FusedAdamW"}


def strategy_classes() -> dict[str, Path]:
    """Rule (a)'s classes, by name, with the file that defines each."""
    found: dict[str, Path] = {}
    for info in pkgutil.iter_modules([str(DATA)]):
        module = importlib.import_module(f"ndtrain.parallel.data.{info.name}")
        for name, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != module.__name__:
                continue
            if issubclass(cls, (nn.Module, torch.optim.Optimizer)) or name.endswith("Strategy"):
                found[name] = Path(module.__file__).resolve()
    return found


def private_fields() -> dict[str, set[Path]]:
    """Rule (b)'s names, each with the parallel/data/ files whose classes define it."""
    out: dict[str, set[Path]] = {}
    for path in sorted(DATA.glob("*.py")):
        for cls in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)):
            for name in _defined_in_class(cls):
                if _private(name):
                    out.setdefault(name, set()).add(path.resolve())
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined_in_class(cls: ast.ClassDef) -> Iterator[str]:
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name
        elif isinstance(node, ast.Assign):
            yield from (t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            yield node.target.id
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    yield t.attr


def _names(node: ast.expr) -> set[str]:
    """The class names an isinstance/comparison operand denotes: `X`, `mod.X`, or a tuple/list/set of them."""
    if isinstance(node, ast.Name):
        return {node.id}
    if isinstance(node, ast.Attribute):
        return {node.attr}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {name for element in node.elts for name in _names(element)}
    return set()


def _is_type_call(node: ast.expr) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "type"


def type_checks(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, class name) of every isinstance/issubclass/type comparison in `tree`."""
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("isinstance", "issubclass")
                and len(node.args) == 2):
            yield from ((node.lineno, name) for name in _names(node.args[1]))
        elif isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.Is, ast.IsNot, ast.Eq, ast.NotEq, ast.In, ast.NotIn)):
            operands = [node.left, *node.comparators]
            if any(_is_type_call(o) for o in operands):
                yield from ((node.lineno, name) for o in operands if not _is_type_call(o) for name in _names(o))


def private_reads(tree: ast.AST, fields: set[str]) -> Iterator[tuple[int, str]]:
    """(line, `x._foo`) of every access to one of `fields` on anything but `self` / `cls`."""
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr in fields
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            yield node.lineno, f"{ast.unparse(node.value)}.{node.attr}"


def package_files() -> list[Path]:
    return sorted(path.resolve() for path in PACKAGE.rglob("*.py"))


def test_the_rules_know_every_strategy_class() -> None:
    classes = strategy_classes()
    assert NAMED <= set(classes), sorted(NAMED - set(classes))
    assert {"_shards", "_buckets", "_grads"} <= set(private_fields())


def test_no_file_asks_a_strategy_its_type() -> None:
    classes = strategy_classes()
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: {name}" for path in package_files()
             for line, name in type_checks(ast.parse(path.read_text())) if name in classes and classes[name] != path]
    assert not found, "type checks on a strategy class outside its own file:\n" + "\n".join(found)


def test_no_file_reads_a_strategy_private_field() -> None:
    fields = private_fields()
    found = []
    for path in package_files():
        foreign = {name for name, owners in fields.items() if path not in owners}
        found += [f"{path.relative_to(PACKAGE.parent)}:{line}: {read}"
                  for line, read in private_reads(ast.parse(path.read_text()), foreign)]
    assert not found, "private fields of parallel/data/ classes read outside their files:\n" + "\n".join(found)


@pytest.mark.parametrize("source, expected", [
    ("isinstance(m, (nn.Module, ZeroOptimizer))", [(1, "Module"), (1, "ZeroOptimizer")]),
    ("type(m) is FSDPStrategy", [(1, "FSDPStrategy")]),
    ("type(m) in (ddp.DDPStrategy, int)", [(1, "DDPStrategy"), (1, "int")]),
    ("m == FSDPStrategy", []),
])
def test_the_type_check_rule_sees_each_form(source: str, expected: list[tuple[int, str]]) -> None:
    assert sorted(type_checks(ast.parse(source))) == sorted(expected)


def test_the_private_field_rule_spares_self_and_cls_only() -> None:
    tree = ast.parse("self._shards\ncls._shards\nengine.optimizer._shards\nsuper()._shards\nx._other")
    assert list(private_reads(tree, {"_shards"})) == [(3, "engine.optimizer._shards"), (4, "super()._shards")]
