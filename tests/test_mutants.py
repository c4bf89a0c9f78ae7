"""scripts/mutants.py's list stays in step with the code: every mutant's snippet occurs exactly once (fast: the
mutants themselves are run by the script, not here)."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_script():
    spec = importlib.util.spec_from_file_location("mutants_script", ROOT / "scripts" / "mutants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_mutant_snippet_occurs_exactly_once():
    script = load_script()
    assert script.check_snippets() == []
    assert len(script.MUTANTS) >= 18


def test_every_mutant_names_test_files_that_exist():
    script = load_script()
    for m in script.MUTANTS:
        assert m.tests, m.name
        for target in m.tests:
            path = ROOT / target.split("::")[0]
            assert path.is_file(), f"{m.name}: {target}"
            name = target.partition("::")[2]
            assert not name or f"def {name}(" in path.read_text(), f"{m.name}: no test {name} in {path.name}"


def test_a_stale_snippet_is_reported(tmp_path):
    script = load_script()
    (tmp_path / "anatomy_helpers").mkdir()
    (tmp_path / "anatomy_helpers" / "x.py").write_text("a = 1\na = 1\n")
    stale = [
        script.Mutant("twice", "x.py", "a = 1", "a = 2", ("t",)),
        script.Mutant("never", "x.py", "b = 1", "b = 2", ("t",)),
        script.Mutant("gone", "y.py", "a", "b", ("t",)),
    ]
    problems = script.check_snippets(stale, tmp_path)
    assert [p.split(":")[0] for p in problems] == ["twice", "never", "gone"]
    assert "occurs 2 times" in problems[0] and "occurs 0 times" in problems[1]
