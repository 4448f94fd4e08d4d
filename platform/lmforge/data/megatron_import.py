"""Importing megatron-core's datasets: quietly, and without the rest of megatron-core.

lmforge uses only ``megatron.core.datasets`` (indexed shards, GPT datasets, the blended builder). Importing any
of it runs ``megatron/core/__init__.py`` first, which imports tensor_parallel, transformer and fusions; the
fusions decorate functions with ``torch.compile`` at import time, and that imports ``torch._dynamo`` and
``torch._inductor``. Together that is more than half of the import cost (about 6 CPU-seconds of 11 on a loaded
2-core machine, measured), paid by every training process for code lmforge never runs.

:func:`quiet_megatron_import` registers the ``megatron.core`` package without running its ``__init__`` (the
package's own submodules still import normally: ``import megatron.core.parallel_state`` works, only the
names the ``__init__`` re-exports, such as ``megatron.core.mpu``, are absent). Where ``megatron.core`` is
already imported (a caller imported it in full first), nothing is changed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import sys
import warnings


def _register_core_package_only() -> None:
    if "megatron.core" in sys.modules:
        return
    import megatron

    spec = importlib.util.find_spec("megatron.core")
    if spec is None or spec.submodule_search_locations is None:  # not installed as a package: import as usual
        return
    core = importlib.util.module_from_spec(spec)  # a package module whose __init__ is not executed
    sys.modules["megatron.core"] = core
    megatron.core = core
    try:  # megatron.core.utils and parallel_state import each other; the __init__ imports parallel_state first
        import megatron.core.parallel_state  # noqa: F401
    except Exception:  # another megatron-core layout: undo, and let the full package import as usual
        for name in [m for m in sys.modules if m == "megatron.core" or m.startswith("megatron.core.")]:
            del sys.modules[name]
        del megatron.core


@contextlib.contextmanager
def quiet_megatron_import():
    """Import megatron-core's datasets without its INFO lines, without its warnings that Transformer Engine /
    Apex are missing (about its own optimizer and FSDP code, which lmforge never runs), and without the
    modules of megatron-core that lmforge never runs: a refusal stays one line, a process starts seconds sooner."""
    logging.getLogger("megatron").setLevel(logging.WARNING)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
        _register_core_package_only()
        yield
