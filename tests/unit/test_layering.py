"""The house is strictly layered: a lower layer never imports a higher one (checked on the source)."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "platform" / "lmforge"

# Lower number = lower layer. A module may import only from its own package or from strictly lower layers,
# except that packages on the same layer listed in SAME_LAYER_OK may import the named peer.
LAYERS = {
    "runtime": 0,
    "config": 1,
    "model": 2,
    "optim": 2.5,  # the optimizer and LR schedule: engines build it from cfg.optim
    "parallel": 3, "comm": 3,
    "data": 4, "checkpoint": 4, "metrics": 4,
    "fault": 4.5,  # fault handling pins checkpoints and writes events through the metrics logger
    "trainer": 5,
    "scaling": 6, "interop": 6, "launch": 6,
    "train": 7,
    "cli": 8,
}
SAME_LAYER_OK = {("parallel", "comm")}


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
    return [m for m in out if m == "lmforge" or m.startswith("lmforge.")]


def test_every_package_has_a_layer():
    for p in PKG.iterdir():
        name = p.stem if p.suffix == ".py" else p.name
        if name.startswith("__") or name.startswith(".") or (p.is_dir() and not (p / "__init__.py").exists()):
            continue
        assert name in LAYERS, f"lmforge.{name} has no layer in tests/unit/test_layering.py"


def test_no_upward_imports():
    bad = []
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG.parent).with_suffix("")
        here = layer_of(".".join(rel.parts))
        if here not in LAYERS:
            continue
        for mod in imports(path):
            there = layer_of(mod)
            if not there or there == here:
                continue
            if LAYERS[there] > LAYERS[here] or (LAYERS[there] == LAYERS[here] and (here, there) not in SAME_LAYER_OK):
                bad.append(f"{rel} imports {mod}")
    assert not bad, "upward or sideways imports:\n" + "\n".join(bad)


def test_model_code_never_imports_distributed():
    for path in (PKG / "model").rglob("*.py"):
        text = path.read_text()
        assert "torch.distributed" not in text, path
