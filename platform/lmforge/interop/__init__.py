"""Hugging Face interop: ``lmforge export hf`` (checkpoint -> HF Llama/StableLM) and ``lmforge import hf``.

See docs/interop.md for the name/config mapping and the architectures that fit.
"""
