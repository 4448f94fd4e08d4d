"""Entry of one rank started by harness.run_ranks: call the target, write its JSON result or traceback."""
from __future__ import annotations

import importlib
import json
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
    with open(result_path, "w") as fh:
        json.dump(payload, fh)
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    return code


if __name__ == "__main__":
    raise SystemExit(main())
