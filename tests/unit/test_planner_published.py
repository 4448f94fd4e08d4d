"""The planner beside published throughput: Megatron-LM's weak-scaling table (Narayanan et al., 2021,
"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", Table 1: GPT with
vocabulary 51,200, sequence 2,048, fp16 mixed precision, full activation recomputation, A100 80 GB at 312
TFLOP/s peak, tensor x pipeline x data parallelism).

The paper reports hardware TFLOP/s per GPU counted with its own formula (recompute included):
    F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h))  per iteration of B sequences,
so its tokens/s per GPU are X * 1e12 * s / (F / B). Megatron ties the embeddings; lmforge cannot with pp > 1,
so those rows are planned untied (the same FLOPs, one more V x h matrix on the last stage). The planner plans the
same layout (micro batch 1, 1F1B, DDP replicas, activation_checkpointing=full). Every published layout ran, so the
planner must accept it (fit in 80 GB); the step model must predict it no faster than every FLOP at the A100's
sustained GEMM rate, and its exposed tensor-parallel time must grow with tp at these fixed per-GPU sizes. The
throughput comparison against every published table, with the held-out figures, is
``benchmarks/planner_validation.py`` (docs/planner.md).
"""

from __future__ import annotations

from lmforge.config.cluster import ClusterConfig
from lmforge.config.model import ModelConfig
from lmforge.config.parallelism import ParallelismConfig
from lmforge.config.schema import RootConfig
from lmforge.config.train import TrainConfig
from lmforge.config.validate import validate
from lmforge.parallel.planner import check_fits, make_plan

VOCAB, SEQ = 51200, 2048

# params (B), heads, hidden, layers, tp, pp, GPUs, global batch, reported TFLOP/s per GPU
MEGATRON_A100 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]


def megatron_flops_per_token(h: int, layers: int) -> float:
    return 96 * layers * h * h * (1 + SEQ / (6 * h) + VOCAB / (16 * layers * h))


def published_config(heads, hidden, layers, tp, pp, gpus, batch) -> RootConfig:
    model = ModelConfig(
        name=f"megatron_{hidden}x{layers}",
        vocab_size=VOCAB,
        d_model=hidden,
        n_layers=layers,
        n_heads=heads,
        d_ff=4 * hidden,
        seq_len=SEQ,
        mlp="gelu",
        norm="layernorm",
        tie_embeddings=pp == 1,
    )
    par = ParallelismConfig(
        name="published", dp_replicate=gpus // (tp * pp), tp=tp, pp=pp, activation_checkpointing="full"
    )
    train = TrainConfig(micro_batch_size=1, global_batch_size=batch, precision="bf16-mixed")
    cluster = ClusterConfig(name="selene", nodes=gpus // 8, gpus_per_node=8, device="a100")
    return validate(RootConfig(model=model, parallelism=par, train=train, cluster=cluster), world_size=gpus)


def test_planner_beside_megatron_published_table():
    rows = []
    for params_b, heads, hidden, layers, tp, pp, gpus, batch, reported in MEGATRON_A100:
        plan = make_plan(published_config(heads, hidden, layers, tp, pp, gpus, batch), gpus)
        check_fits(plan)  # it ran, so it must fit
        # The same model: the paper's parameter formula (it adds biases and learned position embeddings).
        paper_params = 12 * layers * hidden**2 * (1 + 13 / (12 * hidden) + (VOCAB + SEQ) / (12 * layers * hidden))
        tied_params = plan.n_params - (0 if pp == 1 else VOCAB * hidden)
        assert abs(tied_params / paper_params - 1) < 0.01 and abs(paper_params / 1e9 / params_b - 1) < 0.05
        published_tps = reported * 1e12 / megatron_flops_per_token(hidden, layers)
        planner_tps = plan.tokens_per_s / gpus
        planner_hw_tflops = planner_tps * megatron_flops_per_token(hidden, layers) / 1e12
        rows.append(
            (
                params_b,
                tp,
                pp,
                gpus,
                reported,
                planner_hw_tflops,
                published_tps,
                planner_tps,
                planner_tps / published_tps,
                plan.bubble,
                plan.memory.total / 2**30,
                plan.step.tp_comm_s / plan.step_time_s,
                plan.device.gemm_rate("bf16") / 1e12,
            )
        )
    print(
        f"\n{'params':>8}{'tp':>4}{'pp':>4}{'GPUs':>6}{'pub TF/s':>10}{'plan TF/s':>11}{'pub tok/s':>11}"
        f"{'plan tok/s':>12}{'ratio':>7}{'bubble':>8}{'GiB/GPU':>9}"
    )
    for r in rows:
        print(
            f"{r[0]:>7.1f}B{r[1]:>4}{r[2]:>4}{r[3]:>6}{r[4]:>10.0f}{r[5]:>11.1f}{r[6]:>11.0f}{r[7]:>12.0f}"
            f"{r[8]:>7.2f}{r[9]:>8.1%}{r[10]:>9.1f}"
        )
    for r in rows:
        # hardware FLOPs (recompute included) per GPU never exceed the sustained GEMM rate
        assert r[5] < r[12], f"{r[0]}B: predicted {r[5]:.1f} TFLOP/s beats the GEMM rate {r[12]:.0f}"
    tp_share = {r[1]: r[11] for r in rows if r[2] == 1}  # pp = 1 rows: tp 1, 2, 4, 8
    assert tp_share[1] == 0 < tp_share[2] < tp_share[4] < tp_share[8]
