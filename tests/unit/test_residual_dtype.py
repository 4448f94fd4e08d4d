"""The residual stream's dtype under ``train.precision=bf16-mixed`` (parallel/precision.py): bf16 at every block
boundary, the embedding output and the final norm's input, fp32 with ``train.fp32_residual=true``; fp32
parameters, optimizer state and loss either way; and 100 training steps of a tiny model whose losses stay within
0.02 nats of the fp32-residual run at every step. Real engine steps on a one-rank gloo group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lmforge.config.compose import compose
from lmforge.config.errors import ConfigError
from lmforge.config.validate import validate
from lmforge.optim.schedule import lr_multiplier
from lmforge.parallel.memory_estimate import dtypes_for
from lmforge.parallel.native_engine import NativeEngine

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 256
BATCH, SEQ = 2, 32
LOSS_TOLERANCE = 0.02  # nats, at every step


@pytest.fixture(scope="module")
def world():
    """A one-rank gloo group for the module (another test's group is used as it is)."""
    mine = not dist.is_initialized()
    if mine:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if mine:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> str:
    """A real tokenizer file with exactly VOCAB ids (validate() checks the model's vocabulary against it)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from lmforge.config.tokenizer_files import EOD_TOKEN

    words = {f"w{i}": i for i in range(VOCAB - 2)}
    words["<unk>"], words[EOD_TOKEN] = VOCAB - 2, VOCAB - 1
    tok = Tokenizer(WordLevel(words, unk_token="<unk>"))
    tok.add_special_tokens([EOD_TOKEN])
    path = tmp_path_factory.mktemp("tokenizer") / "wordlevel.json"
    tok.save(str(path))
    return str(path)


def tiny(tokenizer: str, *extra: str):
    return validate(
        compose(
            [
                "model=tiny",
                f"model.vocab_size={VOCAB}",
                f"model.seq_len={SEQ}",
                "model.n_layers=2",
                f"data.tokenizer={tokenizer}",
                f"train.micro_batch_size={BATCH}",
                f"train.global_batch_size={BATCH}",
                *extra,
            ]
        ),
        world_size=1,
    )


def engine(tokenizer: str, *extra: str) -> NativeEngine:
    return NativeEngine(tiny(tokenizer, *extra), torch.device("cpu"))


class MicroBatch:
    positions = None  # no document masking (lmforge.data.loader.MicroBatch)

    def __init__(self, tokens: torch.Tensor):
        self.tokens, self.targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def learnable_batches(steps: int):
    """Seeded arithmetic sequences (random start, one of a few strides, mod VOCAB): text a model learns, so the
    loss falls steeply and the comparison covers real training dynamics, not a flat line."""
    gen = torch.Generator().manual_seed(0)
    strides = torch.tensor([1, 3, 7, 11])
    for _ in range(steps):
        start = torch.randint(0, VOCAB, (BATCH, 1), generator=gen)
        stride = strides[torch.randint(0, len(strides), (BATCH, 1), generator=gen)]
        yield MicroBatch((start + stride * torch.arange(SEQ + 1)) % VOCAB)


def residual_dtypes(eng: NativeEngine) -> set:
    """The dtypes seen entering every block and the final norm, and leaving the embedding, in one forward."""
    seen, handles = set(), []
    model = eng.inner
    for name, block in model.layers.items():
        handles.append(block.register_forward_pre_hook(lambda m, a, n=name: seen.add((f"block {n}", a[0].dtype))))
    handles.append(model.norm.register_forward_pre_hook(lambda m, a: seen.add(("final norm", a[0].dtype))))
    handles.append(model.tok_embeddings.register_forward_hook(lambda m, a, out: seen.add(("embedding", out.dtype))))
    mb = next(learnable_batches(1))
    try:
        with torch.no_grad():
            eng.forward_loss(mb.tokens, mb.targets)
    finally:
        for h in handles:
            h.remove()
    return seen


def stream(dtype: torch.dtype) -> set:
    return {("embedding", dtype), ("block 0", dtype), ("block 1", dtype), ("final norm", dtype)}


def test_bf16_mixed_keeps_a_bf16_residual_stream_and_fp32_weights_and_loss(world, tokenizer):
    eng = engine(tokenizer, "train.precision=bf16-mixed")
    assert residual_dtypes(eng) == stream(torch.bfloat16)
    step = eng.train_step([next(learnable_batches(1))], 1e-3)
    assert step.loss.dtype == torch.float32
    assert {p.dtype for p in eng.inner.parameters()} == {torch.float32}  # fp32 master weights
    states = [t for s in eng.optimizer.state.values() for t in s.values() if t.numel() > 1]
    assert states and {t.dtype for t in states} == {torch.float32}  # AdamW moments


def test_fp32_residual_keeps_the_stream_fp32_under_bf16_mixed(world, tokenizer):
    """The negative control of the test above: the flag (and plain fp32) keep every boundary fp32."""
    assert residual_dtypes(engine(tokenizer, "train.precision=bf16-mixed", "train.fp32_residual=true")) == stream(
        torch.float32
    )
    assert residual_dtypes(engine(tokenizer, "train.precision=fp32")) == stream(torch.float32)


def test_bf16_residual_losses_stay_within_0_02_nats_of_fp32_residual_for_100_steps(world, tokenizer, capsys):
    """The smoke experiment's optimizer settings (lr 3e-3, 30 warmup steps, cosine) over 100 steps."""
    losses = {}
    for flag in ("false", "true"):
        cfg = ["train.precision=bf16-mixed", f"train.fp32_residual={flag}", "train.max_steps=100"]
        eng = engine(tokenizer, *cfg, "optim.lr=3e-3", "optim.warmup_steps=30")
        optim = eng.cfg.optim
        losses[flag] = [
            float(eng.train_step([mb], optim.lr * lr_multiplier(i, optim, 100)).loss)
            for i, mb in enumerate(learnable_batches(100))
        ]
    bf16, fp32 = losses["false"], losses["true"]
    assert fp32[-1] < fp32[0] - 1.5, f"the run must learn (loss {fp32[0]:.3f} -> {fp32[-1]:.3f})"
    diffs = [abs(a - b) for a, b in zip(bf16, fp32)]
    assert max(diffs) > 0, "the two runs must differ (else the flag changed nothing)"
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    with capsys.disabled():
        print(f"\nmax |bf16 - fp32 residual| loss over 100 steps: {max(diffs):.5f} nats (step {worst})")
    assert max(diffs) < LOSS_TOLERANCE, f"step {worst}: bf16 {bf16[worst]:.4f} vs fp32 residual {fp32[worst]:.4f}"


def test_fp32_residual_is_refused_where_the_stream_is_bf16_anyway(tokenizer):
    for extra, why in (
        (["train.precision=bf16"], "precision=bf16 keeps the parameters in bf16"),
        (
            ["parallelism.engine=deepspeed", "train.precision=bf16-mixed"],
            "DeepSpeed's bf16 mode (train.precision bf16-mixed or auto) holds bf16 weights",
        ),
    ):
        with pytest.raises(ConfigError) as e:
            tiny(tokenizer, "train.fp32_residual=true", *extra)
        assert str(e.value) == (
            f"config key 'train.fp32_residual': the residual stream is bf16 there: {why}. Fix: set "
            "train.fp32_residual=false, or use train.precision=bf16-mixed on the native engine with "
            "parallelism.param_dtype=fp32"
        )
    tiny(tokenizer, "train.fp32_residual=true", "train.precision=bf16-mixed")  # where it applies: accepted


def test_planner_counts_the_residual_stream_in_the_dtype_used(tokenizer):
    bf16 = dtypes_for(tiny(tokenizer, "train.precision=bf16-mixed").cfg, "bf16-mixed")
    fp32 = dtypes_for(tiny(tokenizer, "train.precision=bf16-mixed", "train.fp32_residual=true").cfg, "bf16-mixed")
    assert (bf16.residual, bf16.compute, bf16.param) == (2, 2, 4)
    assert (fp32.residual, fp32.compute, fp32.param) == (4, 2, 4)
    assert dtypes_for(tiny(tokenizer, "train.precision=fp32").cfg, "fp32").residual == 4
