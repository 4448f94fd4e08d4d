"""``lmforge config show [KEY|GROUP] [overrides]``: what each key of a composition is, and where it came from.

    lmforge config show optim.lr
    lmforge config show parallelism +exp=gpt_1b
    lmforge config show data.sources +exp=smoke data=debian_mix

Composes the config exactly as ``lmforge train`` does and prints, for each key under the selection (every key
when none is given): its value, its default (the dataclass field's), the allowed values (of a choice field, and
of a config group: its presets), the range of a number field, its meaning (the field's docstring, ``config/keys.py``) and which layer set it
(the schema default, ``conf/<group>/<preset>.yaml``, ``conf/exp/<name>.yaml`` or the command line:
``config/presets.py``). An unknown key is one line with the closest known key, exit 2. Hydra's ``--cfg job``
prints the values only.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from omegaconf import OmegaConf

from lmforge.config.choices import closest
from lmforge.config.compose import compose, conf_dir
from lmforge.config.errors import ActionableError, ConfigError
from lmforge.config.keys import catalogue, pattern_of, sections
from lmforge.config.presets import COMMAND_LINE, exp_choices, leaves, load, lookup, preset_layers, source_of

USAGE = "usage: lmforge config show [KEY|GROUP] [+exp=NAME] [group=preset] [key=value ...]"


def fmt(value: Any) -> str:
    """A value as it is written in YAML or on the command line (null, true, 0.0003, [a, b])."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(fmt(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {fmt(v)}" for k, v in value.items()) + "}"
    return str(value)


def plain(text: str) -> str:
    """A docstring's reST literals (````x````) as the terminal shows them (```x```)."""
    return text.replace("``", "`")


def split_args(argv: Sequence[str]) -> Tuple[Optional[str], List[str]]:
    """``(selection, overrides)``: the one argument without ``=`` is the selection (none: every key)."""
    selection = [a for a in argv if "=" not in a]
    if len(selection) > 1 or any(a.startswith("-") for a in selection):
        raise ActionableError(
            "config show",
            f"expected one KEY or GROUP, got {' '.join(selection)}",
            "e.g. lmforge config show optim.lr",
        )
    return (selection[0] if selection else None), [a for a in argv if "=" in a]


def unknown_key(selection: str, known: Sequence[str]) -> ConfigError:
    """The one-line error for a selection that names no key: the closest key by its last part among its
    siblings (as for command-line overrides), else the closest of all keys."""
    parent, _, leaf = selection.rpartition(".")
    siblings = [k for k in known if k.rpartition(".")[0] == parent]
    near = closest(leaf, [k.rpartition(".")[2] for k in siblings]) if siblings else None
    near = f"{parent}.{near}" if near and parent else near or closest(selection, known)
    fix = f"did you mean '{near}'?" if near else "lmforge config show (no KEY) lists every key"
    return ConfigError(selection, "is not a known key", fix)


def selected(values: Mapping[str, Any], selection: Optional[str]) -> List[str]:
    """The dotted leaf keys of the composition under ``selection``; ConfigError when there are none."""
    every = [k for k, _ in leaves(values)]
    if selection is None:
        return every
    hit = [k for k in every if k == selection or k.startswith(selection + ".")]
    if hit:
        return hit
    known = sorted(set(every) | {k for k in catalogue() if "*" not in k} | {s for s, _ in sections()})
    raise unknown_key(selection, known)


def group_lines(conf, group: str, choices: Mapping[str, Any], overrides: Sequence[str]) -> List[str]:
    """The header of a config group: its preset, its presets, where the choice came from."""
    presets = sorted(p.stem for p in (conf / group).glob("*.yaml"))
    exp = choices.get("exp")
    if any(o.lstrip("+").split("=", 1)[0] == group for o in overrides):
        chosen_by = COMMAND_LINE
    elif exp and group in exp_choices(load(conf / "exp" / f"{exp}.yaml")):
        chosen_by = f"conf/exp/{exp}.yaml"
    else:
        chosen_by = "conf/config.yaml"
    return [
        f"{group} = {choices.get(group)}  (config group)",
        f"  choices  {', '.join(presets)}",
        f"  meaning  {plain(dict(sections()).get(group, ''))}",
        f"  set by   {chosen_by}",
        "",
    ]


def key_lines(key: str, value: Any, raw: Any, layers) -> List[str]:
    pattern = pattern_of(key)
    entry = catalogue().get(pattern) if pattern else None
    shown = fmt(value) + (f"  ({raw})" if isinstance(raw, str) and "${" in raw else "")
    lines = [f"{key} = {shown}"]
    if entry is not None:
        lines.append(f"  default  {fmt(entry.default) if '*' not in entry.key else '(no default: a mapping entry)'}")
        if entry.choices:
            lines.append(f"  choices  {', '.join(entry.choices)}")
        if entry.range:
            lines.append(f"  range    {entry.range}")
        lines.append(f"  type     {entry.type}")
        lines.append(f"  meaning  {plain(entry.meaning)}")
    else:  # below a free-form mapping of plain values (comm.env.NCCL_DEBUG)
        parts = key.split(".")
        mapping = next(
            (".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1) if ".".join(parts[:i]) in catalogue())
        )
        lines.append(f"  meaning  an entry of {mapping}: {plain(catalogue()[mapping].meaning)}")
    lines.append(f"  set by   {source_of(layers, key)}")
    return lines


def render(argv: Sequence[str]) -> List[str]:
    """The lines ``lmforge config show`` prints; raises ConfigError for an unknown key or a bad override."""
    selection, overrides = split_args(argv)
    cfg = compose(overrides, return_hydra_config=True)
    choices: Dict[str, Any] = OmegaConf.to_container(cfg.hydra.runtime.choices)
    raw = OmegaConf.to_container(cfg, resolve=False)
    raw.pop("hydra")  # never resolved here: hydra.run.dir would pick (and create) a run directory
    values = OmegaConf.to_container(OmegaConf.create(raw), resolve=True)
    conf = conf_dir()
    layers = preset_layers(conf, choices, overrides)
    out: List[str] = []
    head = (selection or "").split(".")[0]
    if selection and "." not in selection and (conf / head).is_dir() and head != "exp":
        out += group_lines(conf, head, choices, overrides)
    for key in selected(values, selection):
        out += key_lines(key, lookup(values, key), lookup(raw, key), layers) + [""]
    return out[:-1] if out and out[-1] == "" else out


def main(argv: Sequence[str]) -> int:
    argv = list(argv)
    if not argv or argv[0] != "show" or any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip() if argv and argv[0] in ("-h", "--help", "show") else USAGE, file=sys.stderr)
        return 0 if argv and any(a in ("-h", "--help") for a in argv) else 2
    try:
        lines = render(argv[1:])
    except ActionableError as e:  # ConfigError included
        print(f"lmforge: {e}", file=sys.stderr, flush=True)
        return 2
    print("\n".join(lines))
    return 0
