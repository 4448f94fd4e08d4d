"""Data: embedded corpora, tokenizers, Megatron .bin/.idx shards, weighted mixtures and the resumable loader."""
