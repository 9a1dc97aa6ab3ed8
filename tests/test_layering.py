"""Imports only go downward (DESIGN §1): every `trinity_train` import of every module, read from
its source, goes to its own package or to one on a lower layer; the model package knows nothing
of data, distribution, checkpoints, metrics or the CLI."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "trinity_train"

# Top to bottom. A package may import its own layer's packages only where listed in SIDEWAYS.
LAYERS = [
    {"cli"},
    {"calibrate"},  # measures a job's nodes: a training step (train) and the plan's flows and profile (plan)
    {"train", "study", "plan"},
    {"evaluation"},  # probes that run a model as validation does (the passkey probe)
    {"step", "run_config"},
    {"parallel", "checkpoint", "stability", "observe", "health", "interop", "dashboard", "runlock"},
    {"model", "optim", "data", "goodput"},
    {"config", "rundir", "columnar", "records", "callbacks"},
    {"files", "rank_zero", "launcher_verdict", "signals", "kernel_device"},
    {"errors", "__init__"},
    {"exit_codes"},  # the codes a process ends with: below the errors that carry them
]
SIDEWAYS = {
    ("observe", "parallel"),  # layer statistics are global values: they reduce through parallel.reductions
}


def layer_of(package: str) -> int:
    for depth, packages in enumerate(LAYERS):
        if package in packages:
            return depth
    raise AssertionError(f"trinity_train.{package} is on no layer of this test: add it to LAYERS")


def package_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[0]


def imported_packages(path: Path) -> set[str]:
    """The trinity_train packages `path` imports (`from trinity_train import x` names x's module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "trinity_train":
            parts = node.module.split(".")
            if len(parts) > 1:
                found.add(parts[1])
            else:
                found.update(a.name if (PACKAGE / a.name).exists() or (PACKAGE / f"{a.name}.py").exists()
                             else "__init__" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names
                         if a.name.startswith("trinity_train."))
    return found


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_package_is_on_a_layer():
    for module in MODULES:
        layer_of(package_of(module))


@pytest.mark.parametrize("module", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_go_downward(module):
    own = package_of(module)
    for target in imported_packages(module) - {own}:
        upward = layer_of(target) < layer_of(own)
        sideways = layer_of(target) == layer_of(own) and (own, target) not in SIDEWAYS
        assert not (upward or sideways), (
            f"{module.relative_to(PACKAGE)} ({own}, layer {layer_of(own)}) imports trinity_train.{target} "
            f"(layer {layer_of(target)})")


def test_the_model_package_imports_only_config_errors_and_itself():
    # kernel_device: which device's kernels a tensor takes (a planner's fake CPU tensors stand for a GPU's)
    for module in (PACKAGE / "model").rglob("*.py"):
        assert imported_packages(module) <= {"model", "config", "errors", "kernel_device"}, module.name


def test_the_walk_sees_imports():
    """The checks above would pass vacuously if the walk missed imports."""
    assert imported_packages(PACKAGE / "train.py") >= {"checkpoint", "data", "model", "parallel", "stability"}
    assert "model" in imported_packages(PACKAGE / "parallel" / "tensor_parallel.py")


def imported_modules(path: Path) -> set[str]:
    """The trinity_train modules `path` imports, TYPE_CHECKING blocks included (a cycle hidden
    there is still two modules that each need the other to be read)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trinity_train"):
            # `from pkg import submodule` imports the submodule; any other name, pkg itself
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULE_NAMES else node.module
                     for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("trinity_train")]
        found.update(n for n in names if n in MODULE_NAMES)
    return found


def module_name(path: Path) -> str:
    return ".".join(("trinity_train",) + path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")


MODULE_NAMES = {module_name(m) for m in MODULES}


def test_no_two_modules_import_each_other_directly_or_through_others():
    graph = {module_name(m): imported_modules(m) for m in MODULES}
    assert len(graph) > 100 and sum(map(len, graph.values())) > 300  # the walk found the imports
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if target == module:
                continue
            if state.get(target) == "open":
                cycle = path[path.index(target):] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def tooling_imports(path: Path) -> set[str]:
    """The modules `path` imports whose top-level package is not trinity_train (every import, any depth)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_trinity_train_never_imports_the_development_harness():
    """trinity_harness (the tests' and benchmarks' ranks, cluster bed, job runner and instruments)
    is development tooling installed beside the package: nothing in trinity_train may need it, nor
    the tests or benchmarks' own modules."""
    for module in MODULES:
        bad = {m for m in tooling_imports(module) if m.split(".")[0] in ("trinity_harness", "tests", "benchmarks")}
        assert not bad, f"{module.relative_to(PACKAGE)} imports {sorted(bad)}"
    # the check is not vacuous: the walk sees the harness's imports where they are
    assert "trinity_harness.ranks" in tooling_imports(PACKAGE.parent / "tests" / "conftest.py")


MUTATORS = {"append", "extend", "insert", "update", "setdefault", "add", "pop", "popitem", "remove", "discard",
            "clear", "__setitem__"}


def module_state_written(module: Path) -> list[str]:
    """Module-level names of `module` that its code writes into after import: assigned through a
    subscript or a mutating method, or rebound under `global` (a registry, not a constant table)."""
    tree = ast.parse(module.read_text())
    names = {t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
             for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)}
    written = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            written.update(n for n in node.names if n in names)
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            written.update(t.value.id for t in targets if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name)
                           and t.value.id in names)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS
              and isinstance(node.func.value, ast.Name) and node.func.value.id in names):
            written.add(node.func.value.id)
    return sorted(written)


def test_parallel_keeps_no_module_level_mutable_state():
    """What a job's parallel code holds lives in the objects it returns (the gloo room's
    GlooCommunication, the model's FSDP state), never in a module-level registry every model in
    the process would share (constant tables are fine)."""
    found = {str(m.relative_to(PACKAGE)): module_state_written(m) for m in sorted((PACKAGE / "parallel").rglob("*.py"))}
    assert {m: names for m, names in found.items() if names} == {}
    # the check sees a registry where there is one
    assert "_PARAMS_CACHE" in module_state_written(PACKAGE / "plan" / "formula.py")  # a cache, outside parallel/
