"""Reading the file a ``data.tokenizer`` spec names, and its vocabulary size without building any data.

``vocab_size_of(spec)`` is what ``validate()`` compares with ``model.vocab_size`` before any process group or
shard exists; ``lmforge.data.tokenizer`` builds its tokenizers from the same readers, so the two agree by
construction (tests/unit/test_tokenizer_vocab.py checks them against each other). Specs:

- ``embedded``: the byte-level BPE lmforge trains on its embedded corpora, always ``EMBEDDED_VOCAB`` tokens;
- ``path/to/tokenizer.json``: an HF ``tokenizers`` file (loaded: it is cheap, milliseconds for 50k tokens);
- ``tiktoken:/path/to/NAME.tiktoken``: a rank file (the end-of-text token takes the first id left free);
- ``tiktoken:NAME``: a named tiktoken encoding whose file is already in ``$TIKTOKEN_CACHE_DIR`` (read offline).
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Dict

from lmforge.config.errors import ConfigError
from lmforge.runtime.env_vars import read

EOD_TOKEN = "<|endoftext|>"
EMBEDDED_VOCAB = 8192  # the vocabulary the embedded BPE is trained to (data/tokenizer.py build_embedded_tokenizer)


class TokenizerFileError(ConfigError):
    """A ``data.tokenizer`` that cannot be read (one line: the spec, the reason, the fix)."""

    def __init__(self, reason: str, fix: str):
        super().__init__("data.tokenizer", reason, fix)


class MissingTokenizerFile(TokenizerFileError, FileNotFoundError):
    pass


def read_tokenizer_json(path: Path):
    """The ``tokenizers.Tokenizer`` saved at ``path``; it must have an ``<|endoftext|>`` token."""
    from tokenizers import Tokenizer as HFTokenizer

    if not path.is_file():
        raise MissingTokenizerFile(
            f"no tokenizer.json at {path}",
            "give an existing path, 'embedded', or 'tiktoken:NAME' / 'tiktoken:/path/NAME.tiktoken'",
        )
    try:
        backend = HFTokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises plain Exceptions for malformed files
        raise TokenizerFileError(
            f"{path} is not a valid tokenizer.json ({str(e).splitlines()[0][:200]})",
            "point at a file saved by HF tokenizers (Tokenizer.save)",
        ) from None
    if backend.token_to_id(EOD_TOKEN) is None:
        raise TokenizerFileError(
            f"{path} has no '{EOD_TOKEN}' token to end documents with",
            "add it as a special token when training the tokenizer",
        )
    return backend


def read_tiktoken_ranks(path: Path) -> Dict[bytes, int]:
    """The ``<base64 token> <rank>`` lines of a tiktoken file."""
    from tiktoken.load import read_file

    if not path.is_file():
        raise MissingTokenizerFile(
            f"no tiktoken file at {path}",
            "give an existing *.tiktoken file (e.g. gpt2.tiktoken from the openai-whisper sdist, see docs/data.md)",
        )
    ranks: Dict[bytes, int] = {}
    for n, line in enumerate(read_file(str(path)).splitlines(), 1):
        if not line.strip():
            continue
        try:
            tok, rank = line.split()
            ranks[base64.b64decode(tok, validate=True)] = int(rank)
        except ValueError:
            raise TokenizerFileError(
                f"{path}:{n} is not a '<base64 token> <rank>' line", "give a tiktoken rank file"
            ) from None
    return ranks


def end_of_text_id(ranks: Dict[bytes, int]) -> int:
    """The id ``<|endoftext|>`` gets beside a rank file: the first one the ranks leave free (50256 for GPT-2's)."""
    used = set(ranks.values())
    return next(i for i in range(len(used) + 1) if i not in used)


def named_tiktoken(name: str):
    """The tiktoken encoding ``name``, read from ``$TIKTOKEN_CACHE_DIR`` with network access blocked."""
    import tiktoken
    import tiktoken.load as tl

    if not read("TIKTOKEN_CACHE_DIR"):
        raise TokenizerFileError(
            f"tiktoken:{name} needs its file in $TIKTOKEN_CACHE_DIR, which is not set (lmforge never downloads)",
            "use tiktoken:/path/to/FILE.tiktoken, or set "
            "TIKTOKEN_CACHE_DIR to a directory holding the cached file (see docs/data.md)",
        )
    original = tl.read_file

    def offline(blobpath: str) -> bytes:
        if "://" in blobpath:
            raise FileNotFoundError(f"{blobpath} is not cached in $TIKTOKEN_CACHE_DIR")
        return original(blobpath)

    tl.read_file = offline  # read_file_cached looks it up at call time: nothing reaches the network
    try:
        return tiktoken.get_encoding(name)
    except Exception as e:  # noqa: BLE001 - tiktoken raises plain exceptions
        raise TokenizerFileError(
            f"tiktoken encoding '{name}' could not be loaded offline ({e})",
            "put its file in $TIKTOKEN_CACHE_DIR or use tiktoken:/path/to/FILE.tiktoken",
        ) from None
    finally:
        tl.read_file = original


def tiktoken_file_of(spec: str):
    """``Path`` of a ``tiktoken:/path/FILE.tiktoken`` spec, None for ``tiktoken:NAME``."""
    rest = spec.split(":", 1)[1]
    return Path(rest).expanduser() if "/" in rest or rest.endswith(".tiktoken") else None


def vocab_size_of(spec: str) -> int:
    """Token ids the tokenizer ``spec`` can produce (its embedding rows), read without preparing any data."""
    if spec == "embedded":
        return EMBEDDED_VOCAB
    if spec.startswith("tiktoken:"):
        path = tiktoken_file_of(spec)
        if path is None:
            return named_tiktoken(spec.split(":", 1)[1]).n_vocab
        ranks = read_tiktoken_ranks(path)
        return max(max(ranks.values(), default=-1), end_of_text_id(ranks)) + 1
    return read_tokenizer_json(Path(spec).expanduser()).get_vocab_size(with_added_tokens=True)
