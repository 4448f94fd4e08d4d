"""The presets of ``conf/`` against the schema: each default lives in one place.

A key's default is its dataclass field's default (``config/<group>.py``). A group preset
(``conf/<group>/<option>.yaml``) holds only what differs from that default, and an experiment
(``conf/exp/<name>.yaml``) only what differs from the presets it selects. The default presets that
``conf/config.yaml`` selects hold nothing but their ``name`` (so ``RootConfig()`` is the default composition),
except the two groups whose default preset is content rather than a default: ``model`` (``ModelConfig`` holds
the architecture's defaults, ``conf/model/smoke.yaml`` the shape the default run trains) and ``data.sources`` (a
mapping: a schema default would be merged into every data preset's sources).

``findings(conf)`` lists every key that breaks these rules (tests/unit/test_config_presets.py runs it on
``conf/``); ``preset_layers`` and ``source_of`` tell ``lmforge config show`` which file set a key.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from omegaconf import OmegaConf

from lmforge.config.schema import RootConfig

SCHEMA_DEFAULT = "schema default"
COMMAND_LINE = "command line"
# The default presets allowed to set keys (see the module docstring): group -> the keys it may set (None: any).
DEFAULT_PRESET_CONTENT: Dict[str, Optional[Tuple[str, ...]]] = {"model": None, "data": ("sources",)}
_ABSENT = object()


@dataclass(frozen=True)
class Finding:
    """One key of one YAML file that repeats or contradicts a default."""

    file: Path
    key: str
    reason: str

    def __str__(self) -> str:
        return f"{self.file}: {self.key}: {self.reason}"


def schema_defaults() -> Dict[str, Any]:
    """``RootConfig()`` as nested plain dicts (the base layer of every composition)."""
    return OmegaConf.to_container(OmegaConf.structured(RootConfig))


def groups(conf: Path) -> List[str]:
    """The config groups: ``RootConfig`` fields with a ``conf/<group>/`` directory."""
    return [f.name for f in fields(RootConfig) if (conf / f.name).is_dir()]


def load(path: Path) -> Dict[str, Any]:
    """A YAML file as plain dicts, interpolations unresolved (read as Hydra reads it: OmegaConf's loader)."""
    return OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}


def leaves(tree: Mapping[str, Any], prefix: str = "") -> Iterator[Tuple[str, Any]]:
    """``(dotted key, value)`` of every leaf; an empty mapping is a leaf."""
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            yield from leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def lookup(tree: Any, dotted: str) -> Any:
    node = tree
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _ABSENT
        node = node[part]
    return node


def merged(base: Mapping[str, Any], over: Mapping[str, Any]) -> Dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def default_choices(conf: Path) -> Dict[str, str]:
    """``group -> option`` of ``conf/config.yaml``'s defaults list."""
    out: Dict[str, str] = {}
    for item in load(conf / "config.yaml").get("defaults", []):
        if isinstance(item, Mapping):
            out.update({str(k): str(v) for k, v in item.items()})
    return out


def exp_choices(exp: Mapping[str, Any]) -> Dict[str, str]:
    """``group -> option`` an experiment's defaults list overrides (``override /model: gpt_1b``)."""
    out: Dict[str, str] = {}
    for item in exp.get("defaults", []):
        if isinstance(item, Mapping):
            for k, v in item.items():
                out[str(k).replace("override", "").strip().lstrip("/")] = str(v)
    return out


def _preset_findings(conf: Path, group: str, path: Path, base: Mapping[str, Any], is_default: bool) -> List[Finding]:
    data = load(path)
    out: List[Finding] = []
    if "name" in base and data.get("name") != path.stem:
        out.append(Finding(path, f"{group}.name", f"is {data.get('name')!r}, not the file's name {path.stem!r}"))
    allowed = DEFAULT_PRESET_CONTENT.get(group, ())
    for key, value in leaves(data):
        if key == "name":
            continue
        default = lookup(base, key)
        full = f"{group}.{key}"
        if default is not _ABSENT and default == value:
            out.append(
                Finding(path, full, f"repeats the schema default {value!r} (config/{group}.py): delete the line")
            )
        elif is_default and allowed is not None and key.split(".")[0] not in allowed:
            shown = "no default" if default is _ABSENT else f"the schema default {default!r}"
            out.append(
                Finding(
                    path,
                    full,
                    f"the default preset sets {value!r}, contradicting {shown} (config/{group}.py): make {value!r} "
                    "the dataclass default and delete the line",
                )
            )
    return out


def _exp_findings(conf: Path, path: Path, base: Mapping[str, Any], choices: Mapping[str, str]) -> List[Finding]:
    data = load(path)
    picked = {**choices, **exp_choices(data)}
    out: List[Finding] = []
    for key, value in leaves({k: v for k, v in data.items() if k != "defaults"}):
        group = key.split(".", 1)[0]
        preset = conf / group / f"{picked[group]}.yaml" if group in picked else None
        under = merged(base.get(group, {}), load(preset)) if preset is not None else base.get(group, {})
        given = lookup(under, key.split(".", 1)[1]) if "." in key else _ABSENT
        if given is not _ABSENT and given == value and not _other_preset_differs(conf, key, value):
            origin = f"{group}/{picked[group]}.yaml" if preset is not None else f"the schema (config/{group}.py)"
            out.append(Finding(path, key, f"repeats {value!r}, which {origin} already gives: delete the line"))
    return out


def _other_preset_differs(conf: Path, key: str, value: Any) -> bool:
    """Whether some preset of the key's group sets it to another value: then an experiment's line pins the value
    against that preset (``lmforge train parallelism=fsdp +exp=X``) and is no repetition."""
    group, rest = key.split(".", 1)
    if not (conf / group).is_dir():
        return False
    return any(lookup(load(p), rest) not in (_ABSENT, value) for p in (conf / group).glob("*.yaml"))


def findings(conf: Path) -> List[Finding]:
    """Every key of ``conf/`` that repeats a default or contradicts one (empty when the tree keeps the rule)."""
    base = schema_defaults()
    choices = default_choices(conf)
    out: List[Finding] = []
    for group in groups(conf):
        for path in sorted((conf / group).glob("*.yaml")):
            out += _preset_findings(conf, group, path, base[group], choices.get(group) == path.stem)
    for path in sorted((conf / "exp").glob("*.yaml")):
        out += _exp_findings(conf, path, base, choices)
    return out


def preset_layers(conf: Path, choices: Mapping[str, Optional[str]], overrides: Sequence[str]) -> List[Tuple[str, Any]]:
    """The layers of one composition, lowest first: ``(where, tree)`` for the schema, each selected group preset,
    the experiment (``+exp=``) and the command line (key=value overrides, values as typed)."""
    layers: List[Tuple[str, Any]] = [(SCHEMA_DEFAULT, schema_defaults())]
    for group in groups(conf):
        option = choices.get(group)
        if option:
            layers.append((f"conf/{group}/{option}.yaml", {group: load(conf / group / f"{option}.yaml")}))
    exp = choices.get("exp")
    if exp:
        layers.append((f"conf/exp/{exp}.yaml", {k: v for k, v in load(conf / "exp" / f"{exp}.yaml").items()}))
    line: Dict[str, Any] = {}
    for item in overrides:
        key, _, value = item.lstrip("+").partition("=")
        if "." in key and not key.startswith(("~", "hydra.")):
            node = line
            *parents, leaf = key.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
    layers.append((COMMAND_LINE, line))
    return layers


def source_of(layers: Sequence[Tuple[str, Any]], key: str) -> str:
    """The last layer that sets ``key``: where its value came from."""
    for where, tree in reversed(layers):
        if lookup(tree, key) is not _ABSENT:
            return where
    return SCHEMA_DEFAULT
