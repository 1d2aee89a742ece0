"""Mutation testing of infinity's storage, checkpoint and optim code with mutmut 3 (issue 23).

Run from the repository root (one worker, nice'd: the machine is shared):

    pip install -e '.[dev]'                     # mutmut==3.8.1
    nice -n 10 python tools/mutation.py infinity/optim/schedules.py infinity/storage/extents.py
    nice -n 10 python tools/mutation.py infinity.storage infinity.checkpoint infinity.optim  # all

Arguments are modules or packages, as paths (infinity/storage/extents.py, infinity/storage) or
dotted names (infinity.storage.extents, infinity.storage). Options:

    --rev REV           test that commit (default HEAD)
    --worktree          test the working tree (with uncommitted edits) instead of a commit
    --work NAME         run in .mutation/NAME instead of .mutation/work (its own cache)
    --overlay FILE      (repeatable) copy this working-tree file over the snapshot (a new test file, say, on
                        a commit that predates it)
    --fresh             forget cached verdicts (by default killed mutants stay killed while the
                        function they mutate is unchanged; every other verdict is checked again)
    --max-children N    mutmut workers (default 1)
    --tests FILE        (repeatable) an extra test file for every module (added to the mapped ones)
    --only-tests FILE   (repeatable) these test files for every module, instead of the mapped ones
                        (a targeted run; compare only runs made with the same files)
    --recheck           run only the earlier survivors (and no-tests) of these modules, against
                        the current tests; mutants never checked stay unchecked
    --mutants GLOB      (repeatable) run only the mutants whose names match (mutmut's names, e.g.
                        'infinity.storage.manager.xǁFlatStoreǁflip__mutmut_*' for one method,
                        'infinity.storage.swap.x_auto_file_size__mutmut_3' for one mutant; see
                        `mutmut results --all true` in the work directory), checked again even when
                        cached as killed; the report counts only these
    --via-helpers       also map tests that reach a module only through a helper in tests/
    --integration       keep tests/integration and tests/distributed files for modules that unit
                        tests import too (by default a module gets those tests only when no unit
                        test imports it: an engine test costs seconds to a minute for every
                        mutant it covers; tools/mutmut.cfg deselects the distributed marker)
    --show-survivors    print the diff of every surviving mutant after the run

What it does, and why it does it this way:

1. Maps each module to the test files that import it (imports are read with ast, also inside
   functions, and dotted strings such as monkeypatch targets count; --via-helpers adds the tests
   importing a tests/ helper that imports it). Per package, the union of its modules' tests.
   mutmut records which of those tests reach each mutated function and runs only those per mutant.
2. Copies HEAD (or the working tree) into .mutation/work/ -- a consistent snapshot while others keep
   editing the checkout -- writes its setup.cfg from tools/mutmut.cfg plus the modules and tests, and
   runs `mutmut run --max-children N` there. mutmut copies the sources into mutants/ and puts
   mutants/ first on sys.path.
3. The editable install (scikit-build-core, editable.mode=redirect) puts an import finder at the
   front of sys.meta_path that maps every `infinity.*` module to /work/main/infinity/*.py: with it,
   the tests would import the UNMUTATED sources and every mutant would survive (or, worse, a score
   would mean nothing). The run therefore gets PYTHONPATH=<shim>:<work>/mutants where <shim> holds
   an empty module named like the finder's (the `.pth` file imports it by name, and PYTHONPATH comes
   first), so no finder is installed -- in mutmut's process and in any python a test spawns -- and
   `infinity` is imported from mutants/. The native library, which sits only in site-packages, is
   passed as INFINITY_NATIVE_LIB (see infinity/base/native_library.py, formerly infinity/_native.py).
   A preflight checks both in a child
   python before mutmut starts; mutmut's own forced-fail run then checks that mutants are switched
   on (every test must fail when the "fail" mutant is active).
4. Reads mutmut's per-file verdicts and reports per module and per package: mutants, killed,
   survived, timed out, no tests, score = detected / (detected + survived + no tests + suspicious),
   detected = killed + timeout + segfault. The report goes to the screen and to
   .mutation/results.txt (JSON beside it, .mutation/results.json); mutmut's own output goes to
   .mutation/mutmut.log. With --work NAME they are results-NAME.txt/.json and mutmut-NAME.log, and
   the snapshot is staged in .mutation/NAME.staging, so runs in different work directories can go
   at the same time.

Limits of mutmut 3 to keep in mind when reading a score: it mutates code inside functions and
methods only (not module-level constants, not functions with decorators other than
staticmethod/classmethod, e.g. @property), and a test that runs code in a child process kills a
mutant only when the mutant is switched on there too (MUTANT_UNDER_TEST is inherited, so it is).
"""
from __future__ import annotations

import argparse
import ast
import configparser
import fnmatch
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STATE = ROOT / ".mutation"
WORK = STATE / "work"      # --work picks another (each keeps its own mutants/ and verdicts)
SHIM = STATE / "shim"
BASE_CONFIG = ROOT / "tools" / "mutmut.cfg"
PACKAGE = "infinity"
DEFAULT_TARGETS = ["infinity.storage", "infinity.checkpoint", "infinity.optim"]
TRAMPOLINE_MARK = "from mutmut.mutation.trampoline import"


# -- targets and the tests that cover them ---------------------------------------------------------

def module_name(path: Path) -> str:
    """infinity/storage/extents.py -> infinity.storage.extents (a package's __init__ -> the package)."""
    parts = list(path.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def expand_targets(targets: list[str]) -> list[Path]:
    """Module/package arguments -> module files relative to the repository root, in order."""
    out: list[Path] = []
    for target in targets:
        text = target.rstrip("/")
        if text.endswith(".py"):
            rel = Path(text)
        else:
            rel = Path(*text.split(".")) if "/" not in text else Path(text)
        full = ROOT / rel
        if full.is_dir():
            files = sorted(p.relative_to(ROOT) for p in full.rglob("*.py"))
        elif full.with_suffix(".py").is_file():
            files = [rel.with_suffix(".py")]
        elif full.is_file():
            files = [rel]
        else:
            raise SystemExit(f"mutation.py: no module or package {target!r} under {ROOT}")
        for f in files:
            if f.parts[0] != PACKAGE:
                raise SystemExit(f"mutation.py: {f} is not inside {PACKAGE}/")
            if f not in out:
                out.append(f)
    return out


def imported_names(source: str) -> set[str]:
    """Every module name a test file refers to: imports (anywhere in the file) and dotted strings."""
    names: set[str] = set()
    try:
        tree = ast.parse(source)
    except SyntaxError:
        tree = None
    if tree is not None:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
                names.update(f"{node.module}.{a.name}" for a in node.names)
    names.update(re.findall(rf"\b{PACKAGE}(?:\.\w+)+", source))
    return names


def refers_to(names: set[str], module: str) -> bool:
    return any(n == module or n.startswith(module + ".") for n in names)


def map_tests(modules: list[str], tests_root: Path, via_helpers: bool) -> dict[str, list[str]]:
    """module -> test files (relative to tests_root's parent) that import it; with via_helpers also
    those importing a helper module of the tests tree that imports it (tests/integration/parity.py
    imports optim.schedules, and through it ~20 slow engine tests would run for every mutant)."""
    sources = {p: p.read_text(encoding="utf-8", errors="replace") for p in sorted(tests_root.rglob("*.py"))}
    names = {p: imported_names(s) for p, s in sources.items()}
    helpers = {p.stem: p for p in sources if not p.name.startswith("test_") and p.name != "conftest.py"}
    out: dict[str, list[str]] = {}
    for module in modules:
        direct = {p for p, n in names.items() if refers_to(n, module)}
        via_helper = {h for h in helpers if helpers[h] in direct} if via_helpers else set()
        hits = set()
        for p, n in names.items():
            if not p.name.startswith("test_"):
                continue
            if p in direct or any(h in n for h in via_helper):
                hits.add(str(p.relative_to(tests_root.parent)))
        out[module] = sorted(hits)
    return out


# -- the private work copy ---------------------------------------------------------------------------

def snapshot(worktree: bool, staging: Path, rev: str = "HEAD") -> str:
    """A commit (or the working tree) of infinity/, tests/, native/ and pyproject.toml into staging;
    returns a description of what was copied."""
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    if worktree:
        for name in (PACKAGE, "tests", "native"):
            shutil.copytree(ROOT / name, staging / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
        shutil.copy2(ROOT / "pyproject.toml", staging / "pyproject.toml")
        head = git("rev-parse", "--short", "HEAD")
        return f"working tree (HEAD {head} plus uncommitted edits)"
    # native/: a few tests compile its C sources against the installed library (test_check.c)
    data = subprocess.run(["git", "archive", "--format=tar", rev, PACKAGE, "tests", "native",
                           "pyproject.toml"],
                          cwd=ROOT, check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(staging, filter="data")
    return f"{rev} {git('rev-parse', '--short', rev)}"


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def sync(staging: Path, work: Path) -> None:
    """Make work/ match staging/ for infinity/, tests/ and pyproject.toml, rewriting only files whose
    bytes changed: mutmut regenerates a module's mutants when the source is newer than its copy in
    mutants/, so an unchanged file must keep its old mtime and a changed one must get a new one."""
    for top in (PACKAGE, "tests", "native"):
        src_root, dst_root = staging / top, work / top
        wanted = {p.relative_to(src_root) for p in src_root.rglob("*") if p.is_file()}
        if dst_root.exists():
            for p in sorted(dst_root.rglob("*"), reverse=True):
                rel = p.relative_to(dst_root)
                if p.is_file() and rel not in wanted:
                    p.unlink()
                elif p.is_dir() and not any(p.iterdir()):
                    p.rmdir()
        for rel in sorted(wanted):
            src, dst = src_root / rel, dst_root / rel
            if dst.is_file() and dst.read_bytes() == src.read_bytes():
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
    # pytest's settings come from pyproject.toml; a [tool.mutmut] table there would make mutmut
    # ignore setup.cfg, so it is left out.
    text = (staging / "pyproject.toml").read_text()
    text = re.sub(r"(?ms)^\[tool\.mutmut\].*?(?=^\[|\Z)", "", text)
    target = work / "pyproject.toml"
    if not target.is_file() or target.read_text() != text:
        target.write_text(text)


def write_config(work: Path, modules: list[Path], tests: list[str]) -> None:
    parser = configparser.ConfigParser()
    parser.read(BASE_CONFIG)
    section = parser["mutmut"]
    section["only_mutate"] = "\n" + "\n".join(str(m) for m in modules)
    section["pytest_add_cli_args_test_selection"] = "\n" + "\n".join(tests)
    with open(work / "setup.cfg", "w") as f:
        f.write("# Written by tools/mutation.py from tools/mutmut.cfg; do not edit.\n")
        parser.write(f)


def prepare_mutants_dir(work: Path, modules: list[Path], fresh: bool,
                        only: list[str] | None = None) -> list[str]:
    """Keep verdicts that cannot have changed, recheck the rest (``only``: globs of mutant
    names, --mutants; the rest of the verdicts stay as they are, so a later --recheck still
    finds the survivors that run did not select).

    - mutmut's test->function stats are always collected again (they are recorded only for modules
      that carried trampolines in the stats run, and new test files change them).
    - A module copied unmutated by an earlier run (not asked for then) has no trampolines: its copy
      is removed so mutmut mutates it again (its cached verdicts are kept by function hash).
    - Every verdict other than a detection (killed, timeout, segfault) is reset so it is checked against the current tests.
    """
    mutants = work / "mutants"
    reset: list[str] = []
    if fresh and mutants.exists():
        shutil.rmtree(mutants)
    if not mutants.exists():
        return reset
    for name in ("mutmut-stats.json", "mutmut-cicd-stats.json"):
        (mutants / name).unlink(missing_ok=True)
    for m in modules:
        copy = mutants / m
        if copy.is_file() and TRAMPOLINE_MARK not in copy.read_text():
            copy.unlink()
        meta = mutants / (str(m) + ".meta")
        if meta.is_file():
            from mutmut.stats import status_by_exit_code

            data = json.loads(meta.read_text())

            def rechecked(key: str, code) -> bool:
                return code is not None and status_by_exit_code[code] not in DETECTED and \
                    (not only or any(fnmatch.fnmatchcase(key, g) for g in only))
            reset += [k for k, v in data["exit_code_by_key"].items() if rechecked(k, v)]
            data["exit_code_by_key"] = {k: (None if rechecked(k, v) else v)
                                        for k, v in data["exit_code_by_key"].items()}
            meta.write_text(json.dumps(data, indent=4))
    return reset


def write_shim() -> str:
    """An empty module named like the editable install's import finder, for PYTHONPATH (see 3. in the
    module docstring). Returns the finder module's name."""
    finders = [f for f in sys.meta_path if type(f).__module__.startswith("_editable")]
    names = {type(f).__module__ for f in finders}
    pth_dirs = [Path(p) for p in sys.path if p.endswith("site-packages")]
    for d in pth_dirs:
        for pth in d.glob("_editable*infinity*.pth"):
            names.update(re.findall(r"^import (\w+)", pth.read_text(), flags=re.M))
    # written in place, never removed first: a run in another work directory may be starting a
    # python with this directory on its PYTHONPATH, and a moment without the shim there would let
    # that python import the unmutated checkout (every mutant would survive)
    SHIM.mkdir(parents=True, exist_ok=True)
    text = '"""Shadows the editable install\'s import finder during mutation runs (tools/mutation.py)."""\n'
    for name in names:
        shim = SHIM / f"{name}.py"
        if not shim.exists() or shim.read_text() != text:
            shim.write_text(text)
    return ", ".join(sorted(names)) or "(none: not an editable install)"


def native_library() -> str:
    if os.environ.get("INFINITY_NATIVE_LIB"):
        return os.environ["INFINITY_NATIVE_LIB"]
    import importlib.util

    spec = importlib.util.find_spec("infinity.libinfinity_native")
    if spec is None or not spec.origin:
        raise SystemExit("mutation.py: the native library is not installed (pip install -e .)")
    return spec.origin


def run_env(work: Path, native: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SHIM), str(work / "mutants")])
    env["INFINITY_NATIVE_LIB"] = native
    env.pop("MUTANT_UNDER_TEST", None)
    return env


PREFLIGHT = """
import importlib, sys, infinity
for name in ("infinity.base.native_library", "infinity._native"):   # the loader's home, new or old
    try:
        n = importlib.import_module(name)
        break
    except ModuleNotFoundError:
        continue
n.lib()
print(infinity.__file__)
print(n.library_path())
print(any(type(f).__module__.startswith('_editable') for f in sys.meta_path))
"""


def preflight(work: Path, env: dict[str, str], native: str) -> None:
    """A child python with the run's environment imports infinity from the work copy (not the
    checkout) and loads the native library."""
    env = dict(env)
    env["PYTHONPATH"] = os.pathsep.join([str(SHIM), str(work)])
    out = subprocess.run([sys.executable, "-c", PREFLIGHT], cwd=STATE, env=env,
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"mutation.py: preflight failed:\n{out.stdout}{out.stderr}")
    package_file, lib_path, finder = out.stdout.split()
    if not Path(package_file).resolve().is_relative_to(work.resolve()) or finder != "False":
        raise SystemExit(f"mutation.py: preflight imported infinity from {package_file} "
                         f"(editable finder active: {finder}); mutants would not be tested")
    if Path(lib_path).resolve() != Path(native).resolve():
        raise SystemExit(f"mutation.py: preflight loaded {lib_path}, expected {native}")


# -- results -----------------------------------------------------------------------------------------

# mutmut redraws a progress line with a braille spinner; the log keeps only each line's last frame
SPINNER_FRAMES = re.compile(r"[\u2800-\u28ff] [^\u2800-\u28ff\n]*(?=[\u2800-\u28ff])")
DETECTED = ("killed", "timeout", "segfault", "caught by type check")


def read_results(work: Path, modules: list[Path],
                 only: list[str] | None = None) -> dict[str, dict[str, object]]:
    """Verdicts per module (with ``only``: of the mutants whose names match one of these globs)."""
    import fnmatch

    from mutmut.stats import status_by_exit_code

    out: dict[str, dict[str, object]] = {}
    for m in modules:
        meta = work / "mutants" / (str(m) + ".meta")
        counts: dict[str, int] = defaultdict(int)
        survivors: list[str] = []
        if meta.is_file():
            for key, code in json.loads(meta.read_text())["exit_code_by_key"].items():
                if only and not any(fnmatch.fnmatch(key, g) for g in only):
                    continue
                status = status_by_exit_code[code]
                counts[status] += 1
                if status in ("survived", "no tests", "suspicious"):
                    survivors.append(f"{key} ({status})")
        out[module_name(m)] = {"counts": dict(counts), "survivors": survivors}
    return out


def summarize(counts: dict[str, int]) -> dict[str, object]:
    detected = sum(counts.get(s, 0) for s in DETECTED)
    undetected = sum(counts.get(s, 0) for s in ("survived", "no tests", "suspicious"))
    checked = detected + undetected
    return {
        "mutants": sum(counts.values()),
        "killed": counts.get("killed", 0),
        "survived": counts.get("survived", 0),
        "timeout": counts.get("timeout", 0),
        "no_tests": counts.get("no tests", 0),
        "other": sum(v for k, v in counts.items()
                     if k not in ("killed", "survived", "timeout", "no tests")),
        "not_checked": counts.get("not checked", 0),
        "score": (100.0 * detected / checked) if checked else None,
    }


def table(rows: list[tuple[str, dict[str, object]]]) -> str:
    head = f"{'module':44} {'mutants':>7} {'killed':>6} {'surv.':>5} {'t/out':>5} {'no-t':>4} {'other':>5} {'score':>6}"
    lines = [head, "-" * len(head)]
    for name, s in rows:
        score = "-" if s["score"] is None else f"{s['score']:.1f}%"
        lines.append(f"{name:44} {s['mutants']:>7} {s['killed']:>6} {s['survived']:>5} {s['timeout']:>5} "
                     f"{s['no_tests']:>4} {s['other']:>5} {score:>6}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("targets", nargs="*", default=DEFAULT_TARGETS)
    ap.add_argument("--worktree", action="store_true")
    ap.add_argument("--rev", default="HEAD")
    ap.add_argument("--work", default=None,
                    help="work directory under .mutation/ (default work): a separate one keeps "
                         "another set of modules' mutants and cached verdicts apart")
    ap.add_argument("--overlay", action="append", default=[])
    ap.add_argument("--fresh", action="store_true")
    ap.add_argument("--max-children", type=int, default=1)
    ap.add_argument("--tests", action="append", default=[])
    ap.add_argument("--only-tests", action="append", default=[])
    ap.add_argument("--via-helpers", action="store_true")
    ap.add_argument("--recheck", action="store_true")
    ap.add_argument("--mutants", action="append", default=[])
    ap.add_argument("--integration", action="store_true")
    ap.add_argument("--show-survivors", action="store_true")
    args = ap.parse_args(argv)

    STATE.mkdir(exist_ok=True)
    global WORK
    if args.work:
        WORK = STATE / args.work
    modules = expand_targets(args.targets)
    # per work directory, so runs in different work directories can go at once
    staging = STATE / f"{WORK.name}.staging"
    source = snapshot(args.worktree, staging, args.rev)
    for rel in args.overlay:
        target = staging / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / rel, target)
    if args.overlay:
        source += " with working-tree " + " ".join(args.overlay)
    sync(staging, WORK)
    shutil.rmtree(staging)
    names = [module_name(m) for m in modules]
    test_map = map_tests(names, WORK / "tests", args.via_helpers)
    for name in names:
        unit = [t for t in test_map[name]
                if not t.startswith(("tests/integration/", "tests/distributed/"))]
        if unit and not args.integration:
            test_map[name] = unit
        test_map[name] = sorted(set(args.only_tests or test_map[name]) | set(args.tests))
    selection = sorted({t for ts in test_map.values() for t in ts})
    if not selection:
        raise SystemExit("mutation.py: no test imports any of " + ", ".join(names))
    packages: dict[str, list[str]] = defaultdict(list)
    for name in names:
        packages[name.rsplit(".", 1)[0] if name.count(".") > 1 else name].append(name)

    write_config(WORK, modules, selection)
    reset = prepare_mutants_dir(WORK, modules, args.fresh, args.mutants or None)
    finder = write_shim()
    native = native_library()
    env = run_env(WORK, native)
    preflight(WORK, env, native)

    import mutmut

    cmd = ["nice", "-n", "10", shutil.which("mutmut") or "mutmut", "run", "--max-children", str(args.max_children)]
    if args.recheck:
        if not reset:
            raise SystemExit("mutation.py: --recheck: no earlier survivor of these modules to check")
        cmd += reset
    if args.mutants:
        if args.recheck:
            raise SystemExit("mutation.py: --mutants and --recheck: choose one")
        cmd += args.mutants
    header = [
        f"mutation run: mutmut {mutmut.__version__}, source {source}",
        f"command: nice -n 10 python tools/mutation.py {' '.join(sys.argv[1:] if argv is None else argv)}",
        f"  (runs in {WORK.relative_to(ROOT)}: {' '.join(cmd[3:7])}{' <%d survivors>' % len(reset) if args.recheck else ''}{' <%d globs>' % len(args.mutants) if args.mutants else ''}; shimmed finder {finder}; "
        f"INFINITY_NATIVE_LIB={native})",
        "tests per module (files that import it" + (", or a tests/ helper importing it" if args.via_helpers else "") + "):",
    ]
    header += [f"  {n}: {' '.join(test_map[n]) or '(none)'}" for n in names]
    print("\n".join(header), flush=True)

    suffix = "" if args.work is None else f"-{args.work}"
    log_path = STATE / f"mutmut{suffix}.log"
    for attempt in (1, 2):
        with open(log_path, "w") as log:
            raw = b""
            proc = subprocess.Popen(cmd, cwd=WORK, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT)
            assert proc.stdout is not None
            for chunk in iter(lambda: proc.stdout.read1(4096), b""):
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
                raw += chunk
            rc = proc.wait()
            text = SPINNER_FRAMES.sub("", raw.decode(errors="replace"))
            log.write(text)
        # seen once on a fresh work directory with forkserver isolation: the stats run recorded
        # no test for any function although the tests cover them; the same run again is fine
        if rc == 0 or "could not find any test case for any mutant" not in text or attempt == 2:
            break
        print("mutation.py: mutmut's stats run recorded no tests; running it once more", flush=True)

    results = read_results(WORK, modules, args.mutants or None)
    rows = [(n, summarize(results[n]["counts"])) for n in names]
    for pkg, members in packages.items():
        if len(members) > 1:
            total: dict[str, int] = defaultdict(int)
            for n in members:
                for k, v in results[n]["counts"].items():
                    total[k] += v
            rows.append((f"{pkg} (all {len(members)} above)", summarize(total)))
    report = ["", *header, "", table(rows), ""]
    report.append("survivors (survived / no tests / suspicious):")
    for n in names:
        for s in results[n]["survivors"]:
            report.append(f"  {s}")
    report.append(f"mutmut exit status {rc}; its output: {log_path.relative_to(ROOT)}")
    text = "\n".join(report)
    print(text)
    (STATE / f"results{suffix}.txt").write_text(text + "\n")
    (STATE / f"results{suffix}.json").write_text(json.dumps(
        {"source": source, "mutmut": mutmut.__version__, "tests": test_map,
         "modules": {n: {**summarize(results[n]["counts"]), "survivors": results[n]["survivors"]}
                     for n in names}}, indent=2) + "\n")
    if args.show_survivors:
        for n in names:
            for s in results[n]["survivors"]:
                key = s.split(" ")[0]
                subprocess.run(["mutmut", "show", key], cwd=WORK, env=env)
    return rc


if __name__ == "__main__":
    sys.exit(main())
