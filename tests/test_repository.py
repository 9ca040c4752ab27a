"""What a visitor sees: every file the README links to exists, notebooks are stored executed, and the
wheel installs one top-level package."""

import itertools
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
# Markdown links and images to repository files, and repository paths quoted in backticks.
LINKED = {m for m in re.findall(r"\]\(([^)#\s]+)\)", README) if "://" not in m}
QUOTED = set(re.findall(r"`((?:results|notebooks|scripts|models|flexpage|tests|docs)/[\w./-]+\.(?:png|csv|json|ipynb|py|md))`",
                        README))
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_readme_links_and_paths_exist():
    assert LINKED and QUOTED
    missing = sorted(p for p in LINKED | QUOTED if not (ROOT / p).exists())
    assert not missing, f"README points at files missing from the repository: {missing}"


def test_readme_figures_are_tracked_by_git():
    tracked = set(subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                                 check=True).stdout.split())
    untracked = sorted(p for p in LINKED | QUOTED if (ROOT / p).is_file() and p not in tracked)
    assert not untracked, f"README points at files git does not track: {untracked}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_executed(path):
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    assert cells and all(c["execution_count"] for c in cells), "run every cell before committing"
    outputs = [o for c in cells for o in c["outputs"]]
    assert not [o for o in outputs if o["output_type"] == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "a notebook shows its figures"


def test_notebooks_cover_every_benchmark():
    assert {p.stem for p in NOTEBOOKS} == {"latency_vs_length", "throughput", "prefix_sharing", "paged_attention",
                                         "speculative", "long_context"}


@pytest.mark.slow
def test_wheel_has_one_top_level_package(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(tmp_path), str(ROOT)],
                   check=True, timeout=600, capture_output=True)
    (wheel,) = tmp_path.glob("flexpage-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"flexpage"}
    assert "flexpage/configs/llama-small.json" in names  # the zoo works from an installed wheel
    kernel_sources = {p.relative_to(ROOT).as_posix() for p in (ROOT / "flexpage/core").glob("*.c*")}
    assert kernel_sources and kernel_sources <= set(names)  # the kernels build from an installed wheel
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "flexpage = flexpage.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_no_module_reads_the_wrapped_state_or_the_page_tables_internals():
    """The state ``wrap`` keeps is reached through ``flexpage.paged_state`` outside ``hf.py``, the
    page table through its public methods, the pages by the scheduler only through the
    ``BlockManager``, and the server through the Engine's public API."""
    offenders = []
    assert (ROOT / "flexpage/hf.py").is_file() and (ROOT / "flexpage/engine/scheduler.py").is_file()
    for path in sorted((ROOT / "flexpage").rglob("*.py")) + sorted((ROOT / "tests").glob("*.py")):
        text = path.read_text()
        where = path.relative_to(ROOT).as_posix()
        if where != "flexpage/hf.py" and "._flexpage" in text and path.name != "test_repository.py":
            offenders.append(f"{where}: _flexpage")
        offenders += [f"{where}: {m}" for m in re.findall(r"page_table\._\w+", text) if path.name != "test_repository.py"]
        if where == "flexpage/engine/scheduler.py":  # pages through the block manager only
            offenders += [f"{where}: {m}" for m in re.findall(r"page_table|PagedKVCache|\bcache\.", text)]
        if "serve" in path.parts:
            offenders += [f"{where}: {m}" for m in re.findall(r"engine\.(?:_\w+|scheduler)", text)]
    assert not offenders, offenders


def test_device_choices_are_the_policys():
    """CPU-versus-accelerator choices are read from ``flexpage.core.policy`` (one object per device
    kind); only the CPU-only kernels (``linear``, ``memory``, ``kernels``) check that their tensors are on the CPU."""
    allowed = {f"flexpage/core/{name}.py" for name in ("policy", "linear", "memory", "kernels")}
    assert all((ROOT / path).is_file() for path in allowed)
    offenders = [f"{path.relative_to(ROOT)}: {m}" for path in sorted((ROOT / "flexpage").rglob("*.py"))
                 if path.relative_to(ROOT).as_posix() not in allowed and "bench" not in path.parts
                 for m in re.findall(r"device\.type\s*[!=]=|\.is_cuda\b", path.read_text())]
    assert not offenders, offenders


def expand_braces(pattern: str) -> list[str]:
    """``a_{b,c}.{x,y}`` -> every spelled-out name."""
    parts = re.split(r"\{([^}]*)\}", pattern)
    choices = [[part] if i % 2 == 0 else part.split(",") for i, part in enumerate(parts)]
    return ["".join(combo) for combo in itertools.product(*choices)]


def test_results_index_lists_every_file_and_no_other():
    index = (ROOT / "results" / "README.md").read_text()
    folders = {p.name for p in (ROOT / "results").iterdir() if p.is_dir()}
    listed = {name for pattern in re.findall(r"`([\w/{},.-]+\.[\w{},]+)`", index) if pattern.split("/")[0] in folders
              for name in expand_braces(pattern)}
    files = {p.relative_to(ROOT / "results").as_posix() for p in (ROOT / "results").rglob("*")
             if p.is_file() and p.name != "README.md"}
    assert not files - listed, f"results/README.md does not list {sorted(files - listed)}"
    assert not listed - files, f"results/README.md lists missing files {sorted(listed - files)}"


def test_api_reference_covers_every_public_name():
    import flexpage

    documented = set(re.findall(r"^::: flexpage\.(\w+)$", (ROOT / "docs" / "api.md").read_text(), re.M))
    assert documented == set(flexpage.__all__)


@pytest.mark.slow
def test_docs_build_strict(tmp_path):
    """The documentation site builds with every link and reference resolved (``mkdocs --strict``)."""
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                   cwd=ROOT, check=True, capture_output=True, timeout=600)


def test_docs_quote_only_files_that_exist():
    """Paths the documentation quotes in backticks (results, notebooks, scripts, code) exist."""
    pattern = r"`((?:results|notebooks|scripts|models|flexpage|tests|docs)/[\w./-]+\.(?:png|csv|json|ipynb|py|md|sh|txt))`"
    quoted = {m for page in (ROOT / "docs").rglob("*.md") if "results" not in page.relative_to(ROOT / "docs").parts
              for m in re.findall(pattern, page.read_text())}
    assert quoted and not sorted(p for p in quoted if not (ROOT / p).exists())


def module_imports() -> dict[str, set[str]]:
    """Each flexpage module's imports of other flexpage modules, wherever they stand (``TYPE_CHECKING``
    ones and imports inside functions included: a lazy import is a dependency all the same). An
    import from a subpackage (``from ..engine import Engine``) runs its ``__init__`` and counts as an edge to it; the top-level ``flexpage/__init__.py`` imports every
    layer to re-export the public names and is not a target."""
    import ast

    package = ROOT / "flexpage"
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts): p for p in package.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        base = name.split(".")[:-1]  # the module's package ("flexpage.__init__" included)
        edges = set()
        for imp in ast.walk(ast.parse(path.read_text())):  # module level, TYPE_CHECKING and in functions
            if not isinstance(imp, ast.ImportFrom):
                continue
            if imp.level:
                target = ".".join(base[: len(base) - imp.level + 1] + ([imp.module] if imp.module else []))
            elif imp.module.split(".")[0] == "flexpage":
                target = imp.module
            else:
                continue
            for alias in imp.names:
                sub = f"{target}.{alias.name}"
                edges.add(sub if sub in modules else target if target in modules else f"{target}.__init__")
        graph[name] = {e for e in edges if e in modules and e not in ("flexpage.__init__", name)}
    return graph


def test_modules_import_each_other_without_a_cycle():
    """flexpage's modules form layers: no chain of imports, lazy ones included, leads from a module
    back to itself."""
    graph = module_imports()
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            assert state.get(nxt) != 1, f"import cycle: {' -> '.join(path + [nxt])}"
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


# The folders are the layers, bottom first; the rest (serve/, bench/, cli.py, __init__.py) sits on top.
LAYERS = {"errors": 0, "zoo": 0, "core": 1, "hf": 2, "engine": 3}


def test_layers_import_only_downward():
    """The paged core (``flexpage/core``) knows nothing of transformers' wrapping (``hf.py``), which
    knows nothing of the engine (``flexpage/engine``); the server and benchmarks sit on the engine."""
    def layer(module: str) -> int:
        return LAYERS.get(module.split(".")[1], len(LAYERS))

    assert (ROOT / "flexpage/core/__init__.py").is_file() and (ROOT / "flexpage/engine/__init__.py").is_file()
    upward = sorted(f"{source} -> {target}" for source, targets in module_imports().items() for target in targets
                    if layer(target) > layer(source))
    assert not upward, upward
