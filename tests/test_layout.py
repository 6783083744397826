"""The house rules of the layout (README, "Reading order"): the lesson's modules import
without the command-line layer and change nothing in the process; no module imports
another that imports it back, lazy imports included; the top level holds at most 12
files of code; the serving package holds the engine and nothing that measures it."""

import ast
import subprocess
import sys

from conftest import ROOT

LESSON = ["base_model", "kv_cache", "sample", "kv_quant", "weight_quant", "generation.loop",
          "generation.compiled_step", "serving.requests", "serving.model_runner", "serving.engine",
          "serving.request_parsing", "serving.server"]


def test_importing_the_lesson_loads_no_command_line_and_changes_nothing():
    # a fresh interpreter: this one has imported everything already
    code = f"""
import sys
hook, streams = sys.excepthook, (sys.stdin, sys.stdout, sys.stderr)
for name in {LESSON!r}:
    __import__(name)
assert sys.excepthook is hook, "an import replaced sys.excepthook"
assert (sys.stdin, sys.stdout, sys.stderr) == streams, "an import replaced a standard stream"
loaded = sorted(m for m in sys.modules if m in ("plumbing.cli", "plumbing.script"))
print(" ".join(loaded))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == []  # not the command-line layer (torch itself imports argparse)


def our_modules():
    """{module name: path} of every .py file of ours (tests and checkpoints/ aside)."""
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[0] in ("tests", "checkpoints") or any(p.startswith(".") for p in parts):
            continue
        name = ".".join(parts).removesuffix(".__init__")
        modules[name] = path
    return modules


def imports(path, modules):
    """Our modules that the file imports anywhere (in functions too), packages resolved to
    the module named."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def test_no_import_cycles():
    modules = our_modules()
    graph = {m: {n for n in imports(p, modules) if n != m and not m.startswith(n + ".")}
             for m, p in modules.items()}

    def reaches(start, target, seen):
        for n in graph[start]:
            if n == target or (n not in seen and (seen.add(n) or reaches(n, target, seen))):
                return True
        return False
    cycles = [m for m in graph if reaches(m, m, set())]
    assert not cycles, f"modules on an import cycle: {cycles}"


def test_the_top_level_holds_at_most_12_files_of_code():
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(top) <= 12, top


def test_serving_holds_the_engine_only():
    modules = our_modules()
    for name, path in modules.items():
        if name.startswith("serving"):
            used = imports(path, modules)
            assert not any(u.startswith(("benchmarks", "plumbing.cli", "plumbing.script")) for u in used), (name, used)
