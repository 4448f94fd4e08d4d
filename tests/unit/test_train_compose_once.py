"""``lmforge.train`` composes its config once per start (hydra.main composed it twice and the run-name check a third
time) through Hydra's public API only, and what it records in the run directory is what ``@hydra.main`` records."""

from __future__ import annotations

import ast
from pathlib import Path


def private_hydra_imports(source: str) -> list:
    """The ``hydra._*`` modules ``source`` imports (``import hydra._x``, ``from hydra._x import y``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        found += [n for n in names if n.startswith("hydra._")]
    return found


def test_no_platform_module_uses_hydras_private_api():
    platform = Path(__file__).resolve().parents[2] / "platform"
    private = {
        str(path.relative_to(platform)): found
        for path in sorted(platform.rglob("*.py"))
        if (found := private_hydra_imports(path.read_text(encoding="utf-8")))
    }
    assert private == {}
    # Negative control: the scan finds such imports, inside a function too.
    assert private_hydra_imports(
        "def f():\n    from hydra._internal.utils import run_and_report\n    import hydra._internal.callbacks\n"
    ) == ["hydra._internal.utils", "hydra._internal.callbacks"]
    assert private_hydra_imports("from hydra.core.utils import configure_log") == []
