"""The package keeps the shape docs/architecture.md draws: layers that import downward only, no import cycles at any
depth, one job per module (no module past the size where a second job hides)."""

import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 500
"""Past this, a module is split by concern (docs/architecture.md, "Adding code")."""


def test_import_contracts_hold():
    """lint-imports checks pyproject.toml's contracts: the layers, and no cycles between siblings."""
    out = subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; "
                          "lint_imports_command()"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "BROKEN" not in out.stdout and "2 kept, 0 broken" in out.stdout


def test_no_import_cycle_between_any_modules():
    """Stricter than the sibling contract: no chain of imports (function-level ones included) leads from a module
    back to itself, a package's __init__ and its own modules included."""
    graph = grimp.build_graph("slime_hydra")
    cycles = [(m, chain) for m in sorted(graph.modules) for dep in graph.find_modules_directly_imported_by(m)
              if (chain := graph.find_shortest_chain(importer=dep, imported=m))]
    assert not cycles, "\n".join(f"{m}: {' -> '.join(chain)} -> {m}" for m, chain in cycles[:10])


def test_modules_stay_small():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in (ROOT / "slime_hydra").rglob("*.py")}
    assert {p: n for p, n in sizes.items() if n > MAX_LINES} == {}


def test_every_module_sits_in_a_layer():
    """The layers contract names every top-level module and package of slime_hydra (one not named escapes it)."""
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c["layers"] for c in contracts if c["type"] == "layers")
    named = {name.strip().removeprefix("slime_hydra.") for layer in layers for name in layer.replace("|", ":").split(":")}
    top = {p.stem for p in (ROOT / "slime_hydra").iterdir()
           if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}
    assert top - named == set()
