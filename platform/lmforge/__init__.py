"""lmforge: pretrain GPT-style language models from one CPU or GPU up to data-center scale.

Layers, lowest first (a module never imports from a higher layer; ``tests/unit/test_layering.py`` checks it):

    config, runtime  ->  model  ->  parallel, comm  ->  data, checkpoint, metrics, fault
                     ->  trainer  ->  scaling, interop  ->  entry points (train, cli)
"""

__version__ = "0.1.0"
