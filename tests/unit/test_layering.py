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


# No environment reads outside runtime/ (runtime/env_vars.py holds the table of variables lmforge reads).
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
    assert not bad, "environment reads outside runtime/ (use lmforge.runtime.env_vars):\n" + "\n".join(bad)


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


# ---- the import graph: no cycles, lazy imports included ------------------------------------------------------
# Every import of an lmforge module counts, wherever it stands (module level, inside a function, under
# TYPE_CHECKING): a cycle hidden by a function-level import is still a cycle. ``from lmforge.p import m`` names the
# submodule ``lmforge.p.m`` when there is one, else the package ``lmforge.p`` (its ``__init__``).


def module_of(path: Path) -> str:
    name = ".".join(path.relative_to(PKG.parent).with_suffix("").parts)
    return name.removesuffix(".__init__")


def imported_modules(tree: ast.AST, known: set) -> set:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names
            }
    return {m for m in out if m in known}


def import_graph(trees: dict) -> dict:
    """{module: the lmforge modules it imports} for ``trees`` ({module name: parsed source})."""
    known = set(trees)
    return {name: imported_modules(tree, known) - {name} for name, tree in trees.items()}


def import_cycles(graph: dict) -> list:
    """The strongly connected components of more than one module, each sorted (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def source_trees() -> dict:
    return {module_of(p): ast.parse(p.read_text()) for p in sources()}


def test_no_import_cycles():
    cycles = import_cycles(import_graph(source_trees()))
    assert not cycles, "import cycles (move the shared piece into a module below both):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_cycle_rule_finds_a_cycle_hidden_by_a_function_level_import():
    planted = {
        "lmforge.data.a": "from lmforge.data.b import f\n",
        "lmforge.data.b": "def f():\n    from lmforge.data import c\n    return c\n",
        "lmforge.data.c": "import lmforge.data.a\n",
        "lmforge.model.d": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lmforge.model.e import E\n",
        "lmforge.model.e": "class E:\n    def m(self):\n        from lmforge.model.d import X\n",
        "lmforge.model.f": "from lmforge.model.e import E\n",
        "lmforge.data": "",
    }
    graph = import_graph({name: ast.parse(src) for name, src in planted.items()})
    assert import_cycles(graph) == [
        ["lmforge.data.a", "lmforge.data.b", "lmforge.data.c"],
        ["lmforge.model.d", "lmforge.model.e"],
    ]
    # across packages, and through the real tree: a copy of the sources with one planted back edge
    trees = source_trees()
    planted_tree = trees["lmforge.runtime.env_vars"]
    planted_tree.body.append(ast.parse("def planted():\n    from lmforge.cli import main\n").body[0])
    cycles = import_cycles(import_graph(trees))
    assert any("lmforge.runtime.env_vars" in c and "lmforge.cli" in c for c in cycles), cycles


# ---- function-level imports of lmforge modules say why they are deferred ------------------------------------
# A function-level import of an lmforge module is allowed only where it keeps a heavy optional dependency
# (torch, hydra, megatron, deepspeed, transformers, lm_eval, wandb, matplotlib, ...) out of a path that must stay
# light (``lmforge --help``, importing lmforge.data without torch, ...). It carries the reason on its line or on a
# comment line right above it: ``# deferred: <reason>``. Everything else is imported at module level.
DEFERRED = "# deferred:"


def unexplained_function_imports(source: str) -> list:
    tree = ast.parse(source)
    lines = source.splitlines()
    up = parents(tree)
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        else:
            continue
        if not any(n == "lmforge" or n.startswith("lmforge.") for n in names):
            continue
        scope = up.get(node)
        while scope is not None and not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            scope = up.get(scope)
        if scope is None:
            continue  # module level (TYPE_CHECKING blocks included)
        own = lines[node.lineno - 1 : node.end_lineno]
        above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""

        def reason(text: str) -> str:
            return text.split(DEFERRED, 1)[1].strip() if DEFERRED in text else ""

        if not (any(reason(line) for line in own) or (above.startswith("#") and reason(above))):
            bad.append(f"{node.lineno}: {ast.unparse(node)}")
    return sorted(bad, key=lambda f: int(f.split(":")[0]))


def test_function_level_imports_say_why():
    bad = [f"{p.relative_to(PKG)}:{f}" for p in sources() for f in unexplained_function_imports(p.read_text())]
    assert not bad, (
        "function-level imports of lmforge modules without a '# deferred: <reason>' comment (import at module "
        "level, or say which heavy dependency the import keeps off the light path):\n" + "\n".join(bad)
    )


def test_function_import_rule_flags_unexplained_imports():
    source = (
        "from lmforge.config import ConfigError\n"  # 1 module level: fine
        "def f():\n"
        "    from lmforge.data.indexed_shard import read_index\n"  # 3 flagged
        "    import lmforge.model.gpt  # deferred: imports torch\n"  # 4 fine
        "    # deferred: megatron-core takes seconds to import\n"
        "    from lmforge.data.mixture import build_mixture\n"  # 6 fine
        "    from lmforge.data.loader import (  # deferred:\n"  # 7 flagged: no reason given
        "        BatchStream,\n"
        "    )\n"
        "    import json\n"  # 10 not lmforge: fine
        "class C:\n"
        "    def m(self):\n"
        "        from lmforge.runtime.dist import rank  # the rank\n"  # 13 flagged: not a deferral reason
        "        return lambda: __import__('x')\n"
    )
    assert [int(f.split(":")[0]) for f in unexplained_function_imports(source)] == [3, 7, 13]


# ---- keyword-only arguments at package seams ------------------------------------------------------------------
# A public function defined in one lmforge package and imported by name by a module of another package (or a public
# class imported so: its __init__ and public methods) takes at most four parameters positionally (self/cls not
# counted); the rest are keyword-only (``def build_mixture(cfg, tokenizer, *, seq_len, ...)``). ``forward`` is
# exempt: torch calls it through ``Module.__call__`` (hooks and pipeline schedules pass its inputs positionally).
MAX_POSITIONAL = 4


def positional_count(fn: ast.AST) -> int:
    params = fn.args.posonlyargs + fn.args.args
    return len(params) - (1 if params and params[0].arg in ("self", "cls") else 0)


def seam_functions(trees: dict) -> list:
    """Functions called across packages with more than MAX_POSITIONAL positional parameters: "module.qualname"."""
    public = {}  # (module, imported name) -> [(qualname, function node)]
    for name, tree in trees.items():
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                public[(name, node.name)] = [(node.name, node)]
            elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                public[(name, node.name)] = [
                    (f"{node.name}.{m.name}", m)
                    for m in node.body
                    if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and (m.name == "__init__" or not m.name.startswith("_"))
                    and m.name != "forward"
                ]
    bad = set()
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.module in trees):
                continue
            if layer_of(node.module) == layer_of(name):
                continue
            for alias in node.names:
                for qualname, fn in public.get((node.module, alias.name), []):
                    if positional_count(fn) > MAX_POSITIONAL:
                        bad.add(f"{node.module}.{qualname} ({positional_count(fn)} positional, imported by {name})")
    return sorted(bad)


def test_functions_called_across_packages_take_keyword_arguments():
    bad = seam_functions(source_trees())
    assert not bad, (
        f"make the parameters after the first {MAX_POSITIONAL} or fewer keyword-only (add *):\n" + "\n".join(bad)
    )


def test_seam_rule_flags_positional_signatures():
    planted = {
        "lmforge.data.m": (
            "def wide(a, b, c, d, e): ...\n"  # imported by another package: flagged
            "def narrow(a, b, *, c, d, e): ...\n"
            "def local_only(a, b, c, d, e): ...\n"  # used inside data only
            "class Stream:\n"
            "    def __init__(self, a, b, c, d, e): ...\n"  # flagged (self not counted)
            "    def forward(self, a, b, c, d, e): ...\n"  # exempt
            "    def take(self, a, b, c, d): ...\n"
        ),
        "lmforge.data.n": "from lmforge.data.m import local_only\n",
        "lmforge.trainer.t": "def f():\n    from lmforge.data.m import wide, narrow, Stream\n",
    }
    found = seam_functions({name: ast.parse(src) for name, src in planted.items()})
    assert [f.split(" ")[0] for f in found] == ["lmforge.data.m.Stream.__init__", "lmforge.data.m.wide"], found
