"""The package's layers as CONTRIBUTING draws them: each module imports only from its own layer or the ones above
it (no cycles between layers), subpackage __init__ files hold no code, no module passes 500 lines."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "anatomy_helpers"

# layer of each top-level module or subpackage, as in CONTRIBUTING's "Layout"
LAYERS = {
    "core": 1,
    "tracking": 2,
    "training": 3,
    "prediction": 4,
    "distributed": 5,
    **dict.fromkeys(("ui", "cli", "__init__", "__main__"), 6),
    "lessons": 7,
}
ALLOWED: set[tuple[str, str]] = set()  # no upward import: the model counts its own parameters (core.model.param_count)

MODULES = sorted(PACKAGE.rglob("*.py"))


def dotted(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


def imported(path: Path) -> set[str]:
    """Package modules ``path`` imports (relative imports resolved; function-level imports included)."""
    here = dotted(path).split(".")[:-1] if path.name != "__init__.py" else dotted(path).split(".")[:-1]
    found = set()
    tree = ast.parse(path.read_text())
    type_only = {  # imports under `if TYPE_CHECKING:` never run
        id(n)
        for n in ast.walk(tree)
        if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"
        for m in n.body
        for n in ast.walk(m)
    }
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.level:
            base = here[: len(here) - (node.level - 1)]
            if node.module:
                found.add(".".join(base + [node.module]))
            else:  # from . import a, b: submodules
                found.update(".".join(base + [a.name]) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("anatomy_helpers."):
            found.add(node.module.removeprefix("anatomy_helpers."))
    return found


def layer(module: str) -> int:
    return LAYERS[module.split(".")[0]]


def test_every_module_has_a_layer():
    assert {dotted(p).split(".")[0] for p in MODULES} <= set(LAYERS)


@pytest.mark.parametrize("path", MODULES, ids=dotted)
def test_a_module_imports_only_from_its_layer_or_above(path):
    me = dotted(path)
    upward = sorted(
        m for m in imported(path) if layer(m) > layer(me) and (me, m) not in ALLOWED and m.split(".")[0] != "__init__"
    )
    assert upward == [], f"{me} (layer {layer(me)}) imports from a lower layer: {upward}"


def test_the_layer_check_sees_a_violation():
    # the check itself: plots (6) importing a lesson (7) would be refused
    assert layer("lessons.lesson01_forward") > layer("ui.plots") and layer("tracking.trace") < layer("training.train")


def test_ranks_never_imports_world():
    assert "distributed.world" not in imported(PACKAGE / "distributed" / "ranks.py")


@pytest.mark.parametrize("path", sorted(PACKAGE.glob("*/__init__.py")), ids=dotted)
def test_a_subpackage_init_holds_only_its_docstring(path):
    body = ast.parse(path.read_text()).body
    assert len(body) <= 1 and all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body)


@pytest.mark.parametrize("path", MODULES, ids=dotted)
def test_no_module_passes_500_lines(path):
    assert len(path.read_text().splitlines()) <= 500


def test_no_two_modules_import_each_other_even_inside_functions():
    # a cycle hidden by an import inside a function is still a cycle (the old distributed <-> world)
    graph = {dotted(p): {m for m in imported(p) if m in {dotted(q) for q in MODULES}} for p in MODULES}
    cycles = []
    for start in graph:  # depth-first search for a path back to start
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    cycles.append(" -> ".join([*path, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    assert cycles == []


def test_the_package_top_level_holds_its_face_and_subpackages_only():
    entries = sorted(p.name for p in PACKAGE.iterdir() if p.name != "__pycache__")
    assert len(entries) <= 12, entries
    modules = [e for e in entries if e.endswith(".py")]
    assert modules == ["__init__.py", "__main__.py"], modules


@pytest.mark.parametrize("path", MODULES, ids=dotted)
def test_no_module_imports_another_modules_private_names(path):
    private = [
        f"{'.' * n.level}{n.module or ''}: {a.name}"
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").startswith("anatomy_helpers"))
        for a in n.names
        if a.name.startswith("_")
    ]
    assert private == []


@pytest.mark.parametrize("path", MODULES, ids=dotted)
def test_a_function_local_import_is_an_outside_module_with_its_reason_on_the_line(path):
    """A package module is imported at the top (the graph has no cycle, so nothing is half-initialised); a
    function imports only an outside module it loads on purpose late (an optional extra, a heavy or test-only part
    of torch), saying why on the line, or inside a try that handles its absence."""
    source = path.read_text()
    lines, tree = source.splitlines(), ast.parse(source)
    in_try = {id(m) for t in ast.walk(tree) if isinstance(t, ast.Try) for b in t.body for m in ast.walk(b)}
    bad = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for n in ast.walk(fn):
            if not isinstance(n, (ast.Import, ast.ImportFrom)) or id(n) in in_try:
                continue
            package = getattr(n, "level", 0) or (getattr(n, "module", "") or "").startswith("anatomy_helpers")
            if package or "#" not in lines[n.lineno - 1]:
                bad.append(f"line {n.lineno}: {lines[n.lineno - 1].strip()}")
    assert bad == []


# ---- what the package imports from outside, declared where pip reads it ---------------------------------------
def _outside_imports(path: Path) -> set[str]:
    """Top-level names of the modules outside the standard library and this package that ``path`` imports."""
    import sys

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return {m for m in found if m not in sys.stdlib_module_names and m not in ("anatomy_helpers", "__future__")}


def _declared() -> tuple[set[str], dict[str, set[str]]]:
    """(the base dependencies, {extra: its distributions}) from pyproject.toml, as canonical names."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]

    def names(specs):
        return {canonicalize_name(Requirement(s).name) for s in specs}

    return names(project["dependencies"]), {k: names(v) for k, v in project["optional-dependencies"].items()}


#: The modules of the Hugging Face path: what they import from outside the base dependencies is the [hf] extra's.
HF_PATH = [
    *(f"prediction/{m}.py" for m in ("hf", "hf_step", "hf_fit", "hf_fixes", "hf_cuda_rules")),
    *("distributed/hf_fit.py", "cli/hf.py", "lessons/lesson09_finetune.py"),
]
#: Outside modules the package may import without declaring them: IPython comes with ipywidgets (a base
#: dependency), packaging with torch and pip; the imports of these are in kernels or guarded.
INDIRECT = {"IPython", "packaging", "ipykernel"}


def test_every_module_the_hf_path_imports_is_in_the_hf_extra():
    """`pip install "anatomy_helpers[hf]"` brings what lesson 09 imports (a LoRA fine-tune imports peft): checked
    from the source, not from this environment, where every package is installed anyway."""
    from importlib.metadata import packages_distributions

    from packaging.utils import canonicalize_name

    base, extras = _declared()
    dists = packages_distributions()
    wanted = set()
    for rel in HF_PATH:
        for module in _outside_imports(PACKAGE / rel) - INDIRECT:
            wanted.update(canonicalize_name(d) for d in dists.get(module, [module]))
    assert {"transformers", "peft"} <= wanted  # the path's own imports were found
    assert wanted - base - {"torch"} <= extras["hf"], (wanted - base, extras["hf"])


def test_every_outside_module_the_package_imports_is_declared():
    from importlib.metadata import packages_distributions

    from packaging.utils import canonicalize_name

    base, extras = _declared()
    declared = base.union(*extras.values())
    dists = packages_distributions()
    missing = {
        f"{dotted(path)}: {module}"
        for path in MODULES
        for module in _outside_imports(path) - INDIRECT
        if not {canonicalize_name(d) for d in dists.get(module, [module])} & declared
    }
    assert missing == set()
