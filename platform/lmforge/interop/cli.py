"""``lmforge export hf ...``, ``lmforge import hf ...`` and ``lmforge generate ...`` (argument parsing and error
reporting only)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Sequence


def _fail(verb: str, err: Exception) -> int:
    print(f"lmforge {verb}: {err}", file=sys.stderr, flush=True)
    return 2


def export_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="lmforge export", description="Export a training checkpoint to another format.")
    sub = p.add_subparsers(dest="format", required=True)
    hf = sub.add_parser("hf", help="a Hugging Face checkpoint (LlamaForCausalLM; StableLmForCausalLM for LayerNorm)")
    hf.add_argument("source", type=Path, help="run directory, its checkpoints/ or a checkpoints/step-NNNNNNNN dir")
    hf.add_argument("out_dir", type=Path)
    hf.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    hf.add_argument("--max-shard-size", default="5GB", help="split model.safetensors above this size (default 5GB)")
    hf.add_argument("--tokenizer", type=Path, default=None, help="the run's tokenizer.json, if not found by itself")
    hf.add_argument("--no-tokenizer", action="store_true", help="write weights and configs only")
    hf.add_argument("--force", action="store_true", help="replace a non-empty OUT_DIR")
    args = p.parse_args(list(argv))
    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.checkpoint.safe_io import UnsafeCheckpointError

    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.checkpoint.weights import WeightsError

    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.interop.errors import InteropError

    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.interop.export import export_hf

    try:
        res = export_hf(
            args.source,
            args.out_dir,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            tokenizer=args.tokenizer,
            with_tokenizer=not args.no_tokenizer,
            force=args.force,
        )
    except (InteropError, WeightsError, UnsafeCheckpointError, FileNotFoundError) as e:
        return _fail("export", e)
    print(f"exported {res.checkpoint} as {res.architecture} to {res.out_dir}: {', '.join(res.files)}")
    for note in res.notes:
        print(f"note: {note}")
    return 0


def import_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="lmforge import", description="Initialise lmforge weights from another format.")
    sub = p.add_subparsers(dest="format", required=True)
    hf = sub.add_parser("hf", help="a local Hugging Face Llama (or StableLM) safetensors checkpoint")
    hf.add_argument("hf_dir", type=Path)
    hf.add_argument("--out", type=Path, default=None, help="output directory (default runs/import-<name>)")
    hf.add_argument("--name", default=None, help="experiment/model name (default hf_<directory name>)")
    hf.add_argument("--seq-len", type=int, default=None, help="training context (default max_position_embeddings)")
    hf.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    hf.add_argument("--force", action="store_true", help="replace checkpoints already in --out")
    args = p.parse_args(list(argv))
    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.config.errors import ConfigError

    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.interop.errors import InteropError

    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.interop.importer import import_hf

    try:
        res = import_hf(args.hf_dir, args.out, name=args.name, seq_len=args.seq_len, dtype=args.dtype, force=args.force)
    except (InteropError, ConfigError, FileNotFoundError) as e:
        return _fail("import", e)
    print(f"imported {args.hf_dir} -> {res.checkpoint}")
    print(f"experiment config: {res.exp_file}")
    print(f"train from it:     {res.train_command} [overrides]")
    print("or, with the default config tree: lmforge train " + shlex.join(res.overrides))
    for note in res.notes:
        print(f"note: {note}")
    return 0


def generate_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(
        prog="lmforge generate",
        description="Continue prompts with a checkpoint's model "
        "(KV-cached decoding on one process, the run's tokenizer).",
    )
    p.add_argument("source", type=Path, help="run directory, its checkpoints/ or a checkpoints/step-NNNNNNNN dir")
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (the same seed gives the same text)")
    p.add_argument("--stop", action="append", default=[], help="stop after this text (repeatable)")
    p.add_argument("--no-eos", action="store_true", help="do not stop at the end-of-document token")
    p.add_argument("--tokenizer", type=Path, default=None, help="the run's tokenizer.json, if not found by itself")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(list(argv))
    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.checkpoint.safe_io import UnsafeCheckpointError

    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.checkpoint.weights import WeightsError

    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.generation import GenerationError, generate

    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.interop.errors import InteropError

    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.interop.generate import load_for_generation

    try:
        loaded = load_for_generation(args.source, args.tokenizer, args.device)
        tok = loaded.tokenizer
        prompts = [tok.encode(text) or [tok.eod] for text in args.prompt]  # an empty prompt starts a document

        def stop_when(row):
            return bool(args.stop) and any(s in tok.decode(row) for s in args.stop)

        outs = generate(
            loaded.model,
            prompts,
            args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            eos_token_id=None if args.no_eos else tok.eod,
            stop_when=stop_when,
        )
    except (GenerationError, InteropError, WeightsError, UnsafeCheckpointError, FileNotFoundError) as e:
        return _fail("generate", e)
    for i, (text, new) in enumerate(zip(args.prompt, outs)):
        if new and new[-1] == tok.eod and not args.no_eos:
            new = new[:-1]
        continuation = tok.decode(new)
        for s in args.stop:  # cut right after the first stop text
            if s in continuation:
                continuation = continuation[: continuation.index(s) + len(s)]
        if i:
            print("---")
        print(text + continuation, flush=True)
    return 0
