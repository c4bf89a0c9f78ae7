"""scripts/course.py, the setup logic behind lab.sh / test.sh / lab.cmd / test.cmd: the parts a CPU Linux CI can check
for every platform (Windows paths, which torch comes from where, the offline launch). The real installs are in
tests/test_wheelhouse.py."""

import contextlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .test_course import ROOT, load_script

course = load_script("course")


def test_venv_python_on_windows_and_elsewhere():
    venv = Path("C:/course/.venv")
    assert course.venv_python(venv, windows=True) == venv / "Scripts" / "python.exe"
    assert course.venv_python(venv, windows=False) == venv / "bin" / "python"


@pytest.mark.parametrize(
    "system, gpu, index",
    [("Linux", False, course.CPU_INDEX), ("Windows", False, course.CPU_INDEX), ("Linux", True, None),
     ("Darwin", False, None), ("Darwin", True, None)],
)  # fmt: skip
def test_torch_comes_from_the_cpu_index_on_cpu_linux_and_windows(system, gpu, index):
    attempts = course.torch_attempts(system=system, gpu=gpu, version="2.13.0")
    assert attempts[0][1] == ["--no-index", "--no-deps", "torch==2.13.0"]  # a wheel already here: no network
    network = attempts[-1][1]
    assert network[-1] == "torch==2.13.0"
    assert (network[network.index("--index-url") + 1] if "--index-url" in network else None) == index


def test_torch_from_a_wheelhouse_never_reaches_an_index(tmp_path):
    [(_, args)] = course.torch_attempts(system="Linux", gpu=False, wheelhouse=tmp_path)
    assert args[:3] == ["--no-index", "--find-links", str(tmp_path)]


def fake_env(tmp_path) -> "course.Env":
    return course.Env(Path(sys.executable), tmp_path, is_venv=False)


def test_setup_runs_once_then_launches_offline(tmp_path, monkeypatch):
    env = fake_env(tmp_path)
    calls = []
    monkeypatch.setattr(course, "setup", lambda env, **kw: calls.append(kw) or env.stamp.write_text(json.dumps(
        {"key": course.setup_key(kw["dev"]), "learner_key": course.setup_key(False)})))  # fmt: skip
    course.ensure_setup(env, dev=False, gpu=False, wheelhouse=None)
    course.ensure_setup(env, dev=False, gpu=False, wheelhouse=None)
    assert len(calls) == 1  # the second launch touched neither pip nor the network
    course.ensure_setup(env, dev=True, gpu=False, wheelhouse=None)
    course.ensure_setup(env, dev=False, gpu=False, wheelhouse=None)  # a dev setup serves the learner too
    assert [c["dev"] for c in calls] == [False, True]


def test_changed_requirements_set_up_again_and_a_failed_update_still_launches(tmp_path, monkeypatch, capsys):
    env = fake_env(tmp_path)
    env.stamp.write_text(json.dumps({"key": "old", "learner_key": "old"}))

    def offline_setup(env, **kw):
        raise subprocess.CalledProcessError(1, ["pip", "install"])

    monkeypatch.setattr(course, "setup", offline_setup)
    course.ensure_setup(env, dev=False, gpu=False, wheelhouse=None)  # does not raise: launch anyway
    assert "updating failed" in capsys.readouterr().out
    env.stamp.unlink()
    with pytest.raises(subprocess.CalledProcessError):  # never set up: nothing to launch
        course.ensure_setup(env, dev=False, gpu=False, wheelhouse=None)


def test_setup_key_follows_the_requirement_files(tmp_path, monkeypatch):
    req = tmp_path / "requirements.txt"
    req.write_text("numpy\n")
    monkeypatch.setattr(course, "LEARNER_REQUIREMENTS", req)
    before = course.setup_key(False)
    req.write_text("numpy\nscipy\n")
    assert course.setup_key(False) != before


def test_learner_and_development_requirements_are_split():
    learner = (ROOT / "requirements.txt").read_text()
    dev = (ROOT / "requirements-dev.txt").read_text()
    for tool in ("pytest", "ruff", "nbval"):
        assert tool not in learner.split("# The development tools")[0].split("\n", 4)[-1] and tool in dev
    assert "-r requirements.txt" in dev
    names = [line.split(">")[0].split("=")[0].strip() for line in learner.splitlines() if line and line[0] != "#"]
    assert names == ["torch", "numpy", "matplotlib", "ipywidgets", "jupyterlab", "ipykernel", "transformers", "peft"]
    # lesson 09's extra, as pyproject.toml states it (lab.sh installs every lesson's needs)
    hf = re.search(r"^hf = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert {r.strip().strip('"') for r in hf.split(",")} <= set(learner.splitlines())


def test_the_shell_and_windows_wrappers_only_call_course_py():
    for name, command in (("lab", "lab"), ("test", "test")):
        sh = (ROOT / "scripts" / f"{name}.sh").read_text()
        assert f'scripts/course.py {command} "$@"' in sh and "pip install" not in sh
        cmd = (ROOT / "scripts" / f"{name}.cmd").read_bytes()
        assert b"\r\n" in cmd and f"scripts\\course.py {command} %*".encode() in cmd
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_course_py_runs_on_the_standard_library_alone():
    out = subprocess.run(
        [sys.executable, "-I", "-S", str(ROOT / "scripts" / "course.py"), "--help"],  # -S: no site-packages
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "lab" in out.stdout and "--wheelhouse" in out.stdout and "--here" in out.stdout


def test_lab_settings_switch_off_the_news_pop_up():
    settings = json.loads(course.LAB_SETTINGS.read_text())
    assert settings["@jupyterlab/apputils-extension:notification"] == {"checkForUpdates": False, "fetchNews": "false"}
    assert (
        course.lab_settings_target(Path("/env"))
        .as_posix()
        .endswith("share/jupyter/lab/settings/overrides.d/training-step-anatomy.json")
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["--here", "--cpu", "lab", "--port=9"],
        ["lab", "--here", "--cpu", "--port=9"],
        ["--cpu", "lab", "--here", "--port=9"],
    ],
)
def test_options_work_before_and_after_the_command(argv):
    """`bash scripts/lab.sh --here` passes its options after `lab`; an option left out there keeps the one before."""
    args, extra = course.parse_args(argv)
    assert (args.command, args.here, args.gpu, extra) == ("lab", True, False, ["--port=9"])


def test_the_torch_download_shows_progress_and_the_local_attempt_is_quiet(monkeypatch, capsys):
    runs = []
    monkeypatch.setattr(course.subprocess, "run", lambda cmd, **kw: runs.append((cmd, kw)) or
                        subprocess.CompletedProcess(cmd, 1 if len(runs) == 1 else 0))  # fmt: skip
    course.install_torch(course.Env(Path(sys.executable), Path(sys.prefix), False), gpu=False, wheelhouse=None)
    (local, local_kw), (download, download_kw) = runs  # the local wheel fails here, so the download runs
    assert "-q" in local and local_kw["capture_output"]  # an expected failure, not shown
    assert "-q" not in download and not download_kw["capture_output"]  # pip's download line and progress bar
    assert "trying" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra, runs",
    [([], True), (["-x", "-k", "lab"], True), (["tests/test_browser.py"], True), (["-m", "not delivery"], False),
     (["tests/test_setup.py"], False), (["tests/test_setup.py::test_x", "tests/test_browser.py"], True)],
)  # fmt: skip
def test_the_browser_is_prepared_only_for_runs_that_include_the_browser_test(extra, runs):
    assert course.runs_browser_test(extra) == runs


def test_chromium_is_found_or_installed_before_pytest_starts(tmp_path, monkeypatch):
    """Under xdist a test's output reaches the console only when it ends: the install must happen before pytest."""
    runs = []
    monkeypatch.setattr(course.subprocess, "run", lambda cmd, **kw: runs.append(cmd) or
                        subprocess.CompletedProcess(cmd, 0))  # fmt: skip
    course.run_tests(fake_env(tmp_path), [])
    browser = next(i for i, cmd in enumerate(runs) if "ensure_browser" in " ".join(cmd))
    pytest_run = next(i for i, cmd in enumerate(runs) if cmd[1:3] == ["-m", "pytest"])
    assert browser < pytest_run


def test_installing_chromium_says_what_and_why_before_it_starts_and_shows_apt_get(monkeypatch):
    browser_check = load_script("browser_check")
    found = iter([None, "/usr/bin/chromium"])  # missing, then installed
    monkeypatch.setattr(browser_check, "find_chromium", lambda: next(found))
    monkeypatch.setattr(browser_check, "_can_apt", lambda: [])  # root
    events = []
    monkeypatch.setattr(browser_check.subprocess, "run", lambda cmd, **kw: events.append(("run", cmd, kw)) or
                        subprocess.CompletedProcess(cmd, 0, "", ""))  # fmt: skip
    chromium, why = browser_check.ensure_browser(log=lambda m: events.append(("log", m)))
    assert (chromium, why) == ("/usr/bin/chromium", "")
    first = events[0]
    assert first[0] == "log" and "apt-get install chromium" in first[1] and "browser test" in first[1]
    apt = [kw for e, cmd, kw in (e for e in events if e[0] == "run") if "apt-get" in cmd]
    assert len(apt) == 2 and all("stdout" not in kw and not kw.get("capture_output") for kw in apt)  # progress shown


@pytest.mark.parametrize(
    "argv, quick, extra",
    [(["test", "--quick"], True, []), (["test", "-x", "--quick", "-k", "tracker"], True, ["-x", "-k", "tracker"]),
     (["--here", "test", "--quick"], True, []), (["test", "-x"], False, ["-x"])],
)  # fmt: skip
def test_quick_is_an_option_of_test_and_the_rest_goes_to_pytest(argv, quick, extra):
    args, rest = course.parse_args(argv)
    assert (args.command, args.quick, rest) == ("test", quick, extra)


def pytest_runs(monkeypatch, tmp_path, extra, quick):
    """(command lines course.run_tests runs, the environment pytest gets), nothing run."""
    runs = []
    monkeypatch.setattr(course.subprocess, "run", lambda cmd, **kw: runs.append((cmd, kw)) or
                        subprocess.CompletedProcess(cmd, 0))  # fmt: skip
    course.run_tests(fake_env(tmp_path), extra, quick=quick)
    return runs


def test_quick_runs_ruff_and_the_unit_tests_without_notebooks_delivery_tests_or_a_browser(monkeypatch, tmp_path):
    runs = pytest_runs(monkeypatch, tmp_path, ["-x"], quick=True)
    assert not any("ensure_browser" in " ".join(cmd) for cmd, _ in runs)
    assert any(cmd[1:] == ["-m", "ruff", "check", "."] for cmd, _ in runs)
    [cmd] = [cmd for cmd, _ in runs if cmd[1:3] == ["-m", "pytest"]]
    assert "notebooks" not in cmd and not any(a.startswith("--nbval") for a in cmd)
    assert cmd[cmd.index("-m", 3) + 1] == "not delivery" and "tests" in cmd and cmd[-1] == "-x"
    full = [cmd for cmd, _ in pytest_runs(monkeypatch, tmp_path, [], quick=False) if cmd[1:3] == ["-m", "pytest"]][0]
    assert "notebooks" in full and "--nbval" in full and "not delivery" not in full


def test_pytest_and_its_kernels_get_a_passive_openmp_wait_policy_unless_one_is_set(monkeypatch, tmp_path):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    [(_, kw)] = [(cmd, kw) for cmd, kw in pytest_runs(monkeypatch, tmp_path, [], False) if "pytest" in cmd]
    assert kw["env"]["OMP_WAIT_POLICY"] == "PASSIVE"  # xdist workers and nbval's kernels inherit it
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    [(_, kw)] = [(cmd, kw) for cmd, kw in pytest_runs(monkeypatch, tmp_path, [], True) if "pytest" in cmd]
    assert kw["env"]["OMP_WAIT_POLICY"] == "ACTIVE"  # what the user set wins


def test_jupyterlab_starts_with_a_passive_openmp_wait_policy_its_kernels_inherit(monkeypatch, tmp_path):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.chdir(tmp_path)  # run_lab changes into the repository before it execs JupyterLab
    started = []

    def execve(path, argv, env):  # the process becomes JupyterLab: nothing after it runs
        started.append((argv, env))
        raise SystemExit(0)

    monkeypatch.setattr(course, "learner_folder", lambda: tmp_path / "my-work")  # not the checkout's my-work/
    monkeypatch.setattr(course.os, "execve", execve)  # Windows has no exec: subprocess.run
    monkeypatch.setattr(course.subprocess, "run", lambda cmd, **kw: started.append((cmd, kw["env"])) or
                        subprocess.CompletedProcess(cmd, 0))  # fmt: skip
    with pytest.raises(SystemExit) if course.os.name == "posix" else contextlib.nullcontext():
        course.run_lab(fake_env(tmp_path), executed=False, extra=[])
    [(argv, env)] = started
    assert argv[1:4] == ["-m", "jupyter", "lab"] and env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert env["PATH"] == course.os.environ["PATH"]  # the rest of the environment as it was


def test_uv_installs_from_where_pip_would():
    config = "\n".join([
        ":env:.find-links='/opt/wheels'",
        ":env:.cert='/etc/ssl/certs/ca-certificates.crt'",
        "global.constraint='/etc/xdg/pip/constraints.txt'",
        "global.extra-index-url='file:///opt/a/simple file:///opt/b/simple'",
        "global.find-links='/somewhere/else'",  # the variable above overrides the file, as in pip
        "global.index-url='https://mirror.example/simple'",
    ])  # fmt: skip
    flags = course.uv_flags(config)
    pairs = list(zip(flags[0::2], flags[1::2]))
    assert sorted(pairs) == sorted([
        ("--find-links", "/opt/wheels"),
        ("--constraint", "/etc/xdg/pip/constraints.txt"),
        ("--extra-index-url", "file:///opt/a/simple"),
        ("--extra-index-url", "file:///opt/b/simple"),
        ("--index-url", "https://mirror.example/simple"),
        ("--index-strategy", "unsafe-best-match"),  # pip's rule: the best version from any index
    ])  # fmt: skip
    assert course.uv_flags("") == ["--index-strategy", "unsafe-best-match"]


def test_setup_falls_back_to_pip_offline_outside_its_venv_and_when_uv_fails(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(course, "env_has", lambda env, module: True)  # torch is there
    monkeypatch.setattr(course, "pip", lambda env, args, **kw: calls.append(("pip", args[-1])))
    monkeypatch.setattr(course, "fast_install", lambda env, args: calls.append(("uv", args[-1])) or uv_works)
    monkeypatch.setattr(course.shutil, "copyfile", lambda *a: None)
    req = str(course.LEARNER_REQUIREMENTS)
    venv = course.Env(Path(sys.executable), tmp_path, is_venv=True)
    for uv_works, env, wheelhouse, expected in [
        (True, venv, None, [("uv", req)]),
        (False, venv, None, [("uv", req), ("pip", req)]),
        (True, venv, tmp_path, [("pip", req)]),  # offline: pip reads the wheelhouse
        (True, fake_env(tmp_path), None, [("pip", req)]),  # --here: nothing added to the learner's own env
    ]:
        calls.clear()
        course.setup(env, dev=False, gpu=False, wheelhouse=wheelhouse)
        assert calls == [*expected, ("pip", str(course.ROOT))], (uv_works, env.is_venv, wheelhouse)


def test_lab_opens_copies_of_the_learner_notebooks_made_once_and_never_overwritten(tmp_path, monkeypatch):
    learner_copies = load_script("learner_copies")
    work = tmp_path / "my-work"
    made = learner_copies.workspace(work)
    names = sorted(p.name for p in (ROOT / "learner").glob("[0-9][0-9]_*.ipynb"))
    assert [p.name for p in made] == names and len(names) >= 12
    assert (work / names[0]).read_bytes() == (ROOT / "learner" / names[0]).read_bytes()
    (work / names[0]).write_text("the learner's work")
    (work / names[1]).unlink()  # a lesson added to learner/ since the first launch
    assert [p.name for p in learner_copies.workspace(work)] == [names[1]]
    assert (work / names[0]).read_text() == "the learner's work"
    monkeypatch.setattr(learner_copies, "WORK", work)
    monkeypatch.setitem(sys.modules, "learner_copies", learner_copies)  # what course.learner_folder imports
    env = fake_env(tmp_path)
    assert course.lab_command(env, executed=False, extra=[])[4] == str(work)
    assert course.lab_command(env, executed=True, extra=[])[4] == str(ROOT / "notebooks")


def test_git_ignores_the_learners_copies_and_whatever_running_them_writes():
    if subprocess.run(["git", "rev-parse"], cwd=ROOT, capture_output=True).returncode:
        pytest.skip("NOT TESTED: not a git checkout")
    learner_copies = load_script("learner_copies")
    assert learner_copies.WORK == ROOT / "my-work"
    paths = ["my-work/00_tour.ipynb", "my-work/.ipynb_checkpoints/00_tour-checkpoint.ipynb", "my-work/snap.pickle"]
    ignored = subprocess.run(["git", "check-ignore", *paths], cwd=ROOT, capture_output=True, text=True).stdout
    assert ignored.split() == paths
