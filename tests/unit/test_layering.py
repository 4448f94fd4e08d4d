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
    "generation": 2.2,  # KV cache, decode loop, sampling: needs a plain GPT only (evaluation and interop call it)
    "optim": 2.5,  # the optimizer and LR schedule: engines build it from cfg.optim
    "parallel": 3,
    "comm": 3,
    "data": 4,
    "checkpoint": 4,
    "metrics": 4,
    "fault": 4.5,  # fault handling pins checkpoints and writes events through the metrics logger
    "evaluation": 4.7,  # downstream tasks and bits per byte: over the Engine contract, data's tokenizer; the trainer calls it
    # "optim" (lmforge/optim/, from trainer/optim.py) takes its layer here when it lands
    "trainer": 5,
    "scaling": 6,
    "interop": 6,
    "launch": 6,
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


# ---- rules on what code does, not only on what it imports ---------------------------------------------------
# Each rule is a function from a parsed module to its violations ("line: what"), checked on every source file and
# on a snippet that must be flagged (its negative control). Another layer's rule ("optim", ...) goes here the same way.


def sources(exclude_dirs: tuple = ()) -> list[Path]:
    return [p for p in sorted(PKG.rglob("*.py")) if not any(p.relative_to(PKG).parts[0] == d for d in exclude_dirs)]


def check_sources(rule, exclude_dirs: tuple = (), allowed: dict | None = None) -> list[str]:
    bad = []
    for path in sources(exclude_dirs):
        rel = str(path.relative_to(PKG))
        found = rule(ast.parse(path.read_text()))
        if allowed and rel in allowed:
            found = [f for f in found if allowed[rel] not in f]
        bad += [f"{rel}:{f}" for f in sorted(found, key=lambda f: int(f.split(":")[0]))]
    return bad


def by_line(rule, source: str) -> list[int]:
    """The line numbers a rule flags in ``source`` (a negative control)."""
    return sorted(int(f.split(":")[0]) for f in rule(ast.parse(source)))


def parents(tree: ast.AST) -> dict:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


# No environment reads outside runtime/ (runtime/env.py holds the table of variables lmforge reads).
# Allowed: writes (os.environ[k] = v, del, setdefault/pop/update/clear) and whole copies handed to a child
# process (dict(os.environ), {**os.environ, ...}, os.environ.copy()). Everything else is a read.
ENV_WRITES = {"setdefault", "pop", "update", "clear", "copy"}


def env_reads(tree: ast.AST) -> list[str]:
    up = parents(tree)
    environ_names = {
        a.asname or a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.module == "os"
        for a in n.names
        if a.name in ("environ", "environb")
    }
    getenv_names = {
        a.asname or a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.module == "os"
        for a in n.names
        if a.name in ("getenv", "getenvb")
    }
    bad = []
    for node in ast.walk(tree):
        is_environ = (
            isinstance(node, ast.Attribute)
            and node.attr in ("environ", "environb")
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
        ) or (isinstance(node, ast.Name) and node.id in environ_names)
        is_getenv = (
            isinstance(node, ast.Attribute)
            and node.attr in ("getenv", "getenvb")
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
        ) or (isinstance(node, ast.Name) and node.id in getenv_names and isinstance(node.ctx, ast.Load))
        if is_getenv:
            bad.append(f"{node.lineno}: os.getenv")
            continue
        if not is_environ:
            continue
        parent = up.get(node)
        if isinstance(parent, ast.Subscript) and parent.value is node and isinstance(parent.ctx, (ast.Store, ast.Del)):
            continue  # os.environ[k] = v / del os.environ[k]
        if isinstance(parent, ast.Attribute) and parent.attr in ENV_WRITES and isinstance(up.get(parent), ast.Call):
            continue
        if (
            isinstance(parent, ast.Call)
            and isinstance(parent.func, ast.Name)
            and parent.func.id == "dict"
            and parent.args == [node]
            and not parent.keywords
        ):
            continue  # dict(os.environ): a child's environment
        if isinstance(parent, ast.Dict) and any(k is None and v is node for k, v in zip(parent.keys, parent.values)):
            continue  # {**os.environ, ...}: a child's environment
        bad.append(f"{node.lineno}: reads {ast.unparse(parent) if parent is not None else 'os.environ'}")
    return bad


def test_no_environment_reads_outside_runtime():
    bad = check_sources(env_reads, exclude_dirs=("runtime",))
    assert not bad, "environment reads outside runtime/ (use lmforge.runtime.env):\n" + "\n".join(bad)


def test_environment_rule_flags_reads_and_passes_writes():
    flagged = by_line(
        env_reads,
        (
            "import os\nfrom os import environ, getenv\n"
            "a = os.environ['A']\nb = os.environ.get('B')\nc = os.getenv('C')\nd = 'D' in os.environ\n"
            "e = {k: v for k, v in os.environ.items()}\nf(os.environ)\ng = environ.get('G')\nh = getenv('H')\n"
        ),
    )
    assert flagged == [3, 4, 5, 6, 7, 8, 9, 10], flagged
    assert (
        env_reads(
            ast.parse(
                "import os, subprocess\nos.environ['A'] = '1'\ndel os.environ['A']\nos.environ.setdefault('B', '2')\n"
                "os.environ.pop('B', None)\nsubprocess.run(['x'], env=dict(os.environ))\nchild = {**os.environ, 'C': '3'}\n"
                "copy = os.environ.copy()\n"
            )
        )
        == []
    )


# No hasattr/getattr probes on engines: what the trainer and checkpoint code may use of an engine is its contract
# (parallel/contract.py), not a probe.
def engine_hasattr(tree: ast.AST) -> list[str]:
    bad = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("hasattr", "getattr")
            and node.args
        ):
            target = node.args[0]
            name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
            if "engine" in name.lower():
                bad.append(f"{node.lineno}: {ast.unparse(node)}")
    return bad


def test_no_hasattr_on_engines():
    bad = check_sources(engine_hasattr)
    assert not bad, "hasattr on an engine (use the engine's contract):\n" + "\n".join(bad)


def test_engine_hasattr_rule_flags_probes():
    flagged = by_line(
        engine_hasattr,
        (
            "hasattr(engine, 'parts')\nhasattr(self.engine, 'ds')\n"
            "hasattr(ds_engine, 'x')\nhasattr(model, 'no_sync')\n"
            "getattr(engine, 'replica_group', None)\ngetattr(model, 'cfg')\n"
        ),
    )
    assert flagged == [1, 2, 3, 5], flagged


# No module outside parallel/ wraps a model: no import of torch's wrapping/parallelizing modules, and no call of a
# wrapper (DDP, FSDP, tensor/pipeline parallelism, activation-checkpoint wrapping, torch.compile, deepspeed.initialize).
WRAPPING_MODULES = (
    "torch.nn.parallel",
    "torch.distributed.fsdp",
    "torch.distributed._composable",
    "torch.distributed.tensor.parallel",
    "torch.distributed.pipelining",
    "torch.distributed.algorithms._checkpoint",
)
WRAPPING_CALLS = {
    "DistributedDataParallel",
    "DDP",
    "FullyShardedDataParallel",
    "fully_shard",
    "parallelize_module",
    "checkpoint_wrapper",
    "PipelineStage",
}


def model_wrapping(tree: ast.AST) -> list[str]:
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bad += [f"{node.lineno}: import {a.name}" for a in node.names if a.name.startswith(WRAPPING_MODULES)]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith(WRAPPING_MODULES) or (
                node.module == "torch.distributed" and any(a.name in ("fsdp", "pipelining") for a in node.names)
            ):
                bad.append(f"{node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            owner = ast.unparse(f.value) if isinstance(f, ast.Attribute) else ""
            if (
                name in WRAPPING_CALLS
                or (name == "compile" and owner == "torch")
                or (name == "initialize" and owner == "deepspeed")
            ):
                bad.append(f"{node.lineno}: {ast.unparse(f)}(...)")
    return bad


def test_no_model_wrapping_outside_parallel():
    bad = check_sources(model_wrapping, exclude_dirs=("parallel",))
    assert not bad, "a model wrapped outside parallel/ (parallelize assembles the model):\n" + "\n".join(bad)


def test_wrapping_rule_flags_wrappers():
    flagged = by_line(
        model_wrapping,
        (
            "from torch.nn.parallel import DistributedDataParallel as DDP\nimport torch.distributed.fsdp\n"
            "from torch.distributed.tensor.parallel import parallelize_module\nm = torch.compile(m)\n"
            "e, *_ = deepspeed.initialize(model=m)\nfully_shard(m)\nm = DDP(m)\n"
            "from torch.distributed.checkpoint import save\nx = re.compile('a')\n"
        ),
    )
    assert flagged == [1, 2, 3, 4, 5, 6, 7], flagged
