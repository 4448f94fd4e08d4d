"""Text generation with lmforge's GPT: an exactly sized KV cache, prefill + incremental decode, greedy and
sampled decoding of ragged batches, stop sequences (docs/evaluation.md, "Generation").

    from lmforge.generation import generate
    new_ids = generate(model, [prompt_ids, ...], max_new_tokens=32, temperature=0.0, stop=[[...]])

Above ``model/`` and below everything that trains: it needs a plain single-process GPT and nothing else.
"""

from lmforge.generation.decode import generate
from lmforge.generation.kv_cache import KVCache, kv_cache_bytes
from lmforge.generation.sampling import GenerationError, Sampling

__all__ = ["generate", "KVCache", "kv_cache_bytes", "GenerationError", "Sampling"]
