"""Entry of one rank started by harness.run_ranks: call the target, write its JSON result or traceback."""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback


def main() -> int:
    target, args_json, result_path = sys.argv[1], sys.argv[2], sys.argv[3]
    module_name, func_name = target.split(":")
    try:
        func = getattr(importlib.import_module(module_name), func_name)
        value = func(**json.loads(args_json))
        payload = {"value": value}
        code = 0
    except BaseException:  # noqa: BLE001 - report everything, including SystemExit
        payload = {"error": traceback.format_exc()}
        code = 1
    # Written whole or not at all: a rank killed at the harness's timeout never leaves half a JSON file behind.
    partial = result_path + ".partial"
    with open(partial, "w") as fh:
        json.dump(payload, fh)
    os.replace(partial, result_path)
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    return code


if __name__ == "__main__":
    raise SystemExit(main())
