"""``lmforge wandb workspace``: a W&B workspace for lmforge runs, built with W&B's own workspace API
(``wandb-workspaces``), so a project's runs open on the panels this page lists instead of W&B's automatic grid.

    lmforge wandb workspace --project lmforge [--entity TEAM] [--name "lmforge runs"]    # saves it (API key)
    lmforge wandb workspace --project lmforge --out workspace.json                       # writes the view only

Every panel plots series the sinks log (metrics/series.py) against ``trainer/step`` (the loss also against
``tokens_seen``); per-source and per-task series are matched by a regular expression, so one workspace fits every
data mixture and task list. ``--out`` writes the view W&B would store (entity, project, name, spec) without an API
key; saving needs one (``wandb login``), and without it the command says so in one line (exit 2).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from lmforge.metrics.wandb_sink import STEP_METRIC, api_key_present, server_host
from lmforge.runtime.env_vars import environment
from lmforge.runtime.file_modes import write_text

# section -> panels: (title, x axis, y series, or a regular expression over series names: "re:<pattern>")
PANELS: Dict[str, List[Tuple[str, str, List[str]]]] = {
    "Loss": [
        ("training loss", STEP_METRIC, ["train/loss"]),
        ("training loss by tokens", "tokens_seen", ["train/loss"]),
        ("validation loss per source", STEP_METRIC, ["re:val/.*/loss"]),
        ("validation bits per byte per source", STEP_METRIC, ["re:val/.*/bpb"]),
        ("learning rate and gradient norm", STEP_METRIC, ["train/lr", "train/grad_norm"]),
    ],
    "Throughput": [
        ("tokens/s", STEP_METRIC, ["train/tokens_per_s", "train/predicted_tokens_per_s"]),
        ("MFU, measured and planned", STEP_METRIC, ["train/mfu", "train/predicted_mfu"]),
        ("step time, measured and planned", STEP_METRIC, ["train/step_time_s", "train/predicted_step_time_s"]),
        ("data wait per step", STEP_METRIC, ["train/data_wait_s"]),
    ],
    "Memory": [
        ("peak memory per device, measured and planned", STEP_METRIC,
         ["train/peak_memory_gib", "train/predicted_peak_memory_gib"]),
    ],
    "Data mixture": [
        ("tokens per source", STEP_METRIC, ["re:tokens/.*"]),
    ],
    "Communication": [
        ("communication overlap", STEP_METRIC, ["comm/overlap_fraction", "comm/overlap_fraction_min"]),
        ("exposed and total communication", STEP_METRIC, ["comm/exposed_ms", "comm/total_ms"]),
    ],
    "Goodput": [
        ("goodput", STEP_METRIC, ["goodput/fraction"]),
        ("time lost by cause", STEP_METRIC, ["re:goodput/.*_s"]),
        ("checkpoint save stall and write", STEP_METRIC, ["checkpoint/stall_s", "checkpoint/write_s"]),
    ],
    "Evaluation": [
        ("downstream accuracy per task", STEP_METRIC, ["re:eval/.*/acc"]),
    ],
}  # fmt: skip
MULTI_RANK = ("Communication",)  # sections whose series only a run of more than one process logs


def panel_series(sections: Sequence[str] = tuple(PANELS)) -> List[str]:
    """Every series a panel of ``sections`` plots: names, and ``re:<pattern>`` for the matched ones."""
    return [y for name in sections for _, _, ys in PANELS[name] for y in ys]


def unmatched(series: Sequence[str], names: Iterable[str]) -> List[str]:
    """The panel series (``panel_series``) no logged series name satisfies: a name must be there, a ``re:``
    pattern must match at least one name in full."""
    names = set(names)
    return [
        y
        for y in series
        if not (any(re.fullmatch(y[len("re:") :], n) for n in names) if y.startswith("re:") else y in names)
    ]


def build_workspace(project: str, entity: str, name: str):
    """The workspace as W&B's API object (``wandb_workspaces.workspaces.Workspace``)."""
    import wandb_workspaces.reports.v2 as wr  # deferred: wandb-workspaces loads only for this command
    import wandb_workspaces.workspaces as ws

    def panel(title: str, x: str, ys: List[str]):
        names = [y for y in ys if not y.startswith("re:")]
        patterns = [y[len("re:") :] for y in ys if y.startswith("re:")]
        return wr.LinePlot(title=title, x=x, y=names, metric_regex=patterns[0] if patterns else None)

    sections = [
        ws.Section(name=section, panels=[panel(*p) for p in panels], is_open=True) for section, panels in PANELS.items()
    ]
    return ws.Workspace(entity=entity, project=project, name=name, sections=sections)


def view_json(workspace) -> dict:
    """What W&B stores for the workspace (its view): the spec the upload sends, and where it goes."""
    view = workspace._to_model()
    return {
        "entity": view.entity,
        "project": view.project,
        "name": view.display_name,
        "spec": json.loads(view.spec.model_dump_json(by_alias=True, exclude_none=True)),
    }


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="lmforge wandb workspace", description=__doc__.split("\n\n")[0])
    ap.add_argument("--project", required=True, help="the W&B project whose runs the workspace shows")
    ap.add_argument("--entity", default=None, help="team or user (default: the API key's default entity)")
    ap.add_argument("--name", default="lmforge runs", help="the workspace's name in the project's workspace list")
    ap.add_argument("--out", type=Path, default=None, help="write the view as JSON here instead of saving it")
    return ap.parse_args(list(argv))


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "workspace":
        print("usage: lmforge wandb workspace --project P [--entity E] [--name NAME] [--out FILE]", file=sys.stderr)
        return 2
    args = parse_args(argv[1:])
    panels = sum(len(p) for p in PANELS.values())
    if importlib.util.find_spec("wandb_workspaces") is None:
        print(
            "lmforge wandb workspace: needs W&B's workspace API, the wandb-workspaces package, which is not installed. "
            "Fix: pip install 'lmforge[workspace]'",
            file=sys.stderr,
        )
        return 2
    if args.out is not None:
        view = view_json(build_workspace(args.project, args.entity or "-", args.name))
        write_text(args.out, json.dumps(view, indent=1) + "\n")
        print(
            f"lmforge: workspace '{args.name}' ({len(PANELS)} sections, {panels} panels) written to {args.out}; "
            "nothing saved to W&B (--out)"
        )
        return 0
    env = environment()
    if not api_key_present(env, server_host(env)):
        print(
            "lmforge wandb workspace: saving needs a W&B API key and none was found (WANDB_API_KEY, ~/.netrc). "
            "Fix: wandb login, or --out FILE to write the view without saving it",
            file=sys.stderr,
        )
        return 2
    import wandb

    entity = args.entity or wandb.Api().default_entity
    saved = build_workspace(args.project, entity, args.name).save()
    print(f"lmforge: workspace '{args.name}' ({len(PANELS)} sections, {panels} panels) saved: {saved.url}")
    return 0
