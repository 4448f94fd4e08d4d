"""The GPU peak table matches the exact device by the name and memory that CUDA reports, and refuses to guess.

Names are the strings ``torch.cuda.get_device_properties(...).name`` returns on those GPUs; memory is their
``total_memory`` (the MiB figure nvidia-smi prints, in bytes).
"""

from __future__ import annotations

import pytest

from lmforge.runtime.hardware import DEVICE_MEMORY_GIB, GPU_SPECS, KIND_ALIASES, PEAK_TFLOPS, match_gpu

MIB = 2**20

# (device name, total memory in MiB, kind, dense bf16 TFLOP/s from the datasheet)
REAL_DEVICES = [
    ("NVIDIA H100 80GB HBM3", 81559, "h100_sxm", 989.4),
    ("NVIDIA H100 PCIe", 81559, "h100_pcie", 756.5),
    ("NVIDIA H100 NVL", 95830, "h100_nvl", 835.5),
    ("NVIDIA H200", 143771, "h200", 989.4),
    ("NVIDIA H200 NVL", 143771, "h200_nvl", 835.5),
    ("NVIDIA A100-SXM4-40GB", 40536, "a100_40gb", 312.0),
    ("NVIDIA A100-PCIE-40GB", 40536, "a100_40gb", 312.0),
    ("NVIDIA A100-SXM4-80GB", 81920, "a100_80gb", 312.0),
    ("NVIDIA A100 80GB PCIe", 81920, "a100_80gb", 312.0),
    ("NVIDIA B200", 183359, "b200", 2250.0),
    ("NVIDIA L40S", 46068, "l40s", 362.05),
]


@pytest.mark.parametrize("name,mib,kind,bf16", REAL_DEVICES)
def test_real_device_names_match_their_exact_spec(name, mib, kind, bf16):
    spec = match_gpu(name, mib * MIB)
    assert spec is not None and spec.kind == kind, (name, spec)
    assert spec.peaks["bf16"] == bf16 and PEAK_TFLOPS[kind]["bf16"] == bf16
    assert spec.peaks["fp16"] == bf16 and spec.peaks["fp32"] < bf16


@pytest.mark.parametrize(
    "name,mib",
    [
        ("NVIDIA H800", 81559),  # another Hopper part: not an H100
        ("NVIDIA H100 80GB HBM3", 65536),  # an H100 whose memory fits no H100 spec (e.g. a 64 GB part)
        ("NVIDIA A100-SXM4-80GB", 20 * 1024),  # a MIG slice: not the whole GPU
        ("NVIDIA GeForce RTX 4090", 24564),
        ("NVIDIA A10G", 23028),
        ("NVIDIA GH200 480GB", 97280),
    ],
)
def test_unknown_or_ambiguous_devices_get_no_guess(name, mib):
    assert match_gpu(name, mib * MIB) is None


def test_every_name_matches_at_most_one_spec_and_aliases_point_at_real_specs():
    for name, mib, kind, _ in REAL_DEVICES:
        lowered = name.lower().replace("-", " ")
        fits = [
            s.kind
            for s in GPU_SPECS
            if all(t in lowered for t in s.tokens)
            and not any(x in lowered for x in s.excludes)
            and s.memory_gib[0] <= mib / 1024 <= s.memory_gib[1]
        ]
        assert fits == [kind]
    for alias, kind in KIND_ALIASES.items():
        assert PEAK_TFLOPS[alias] == PEAK_TFLOPS[kind] and DEVICE_MEMORY_GIB[alias] == DEVICE_MEMORY_GIB[kind]
