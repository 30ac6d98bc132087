"""HF Trainer / TRL runs with and without cpshard's CP, on gloo ranks and in one process.

Every run builds the same tiny Llama (from a config, fixed seed), the same tiny word-level
tokenizer (built in memory) and the same data, trains a few steps, and returns the loss of every
step (``trainer.state.log_history``, ``logging_steps=1``) and the final weights. The CP runs go
through ``cpshard.integrations``; the references are the stock trainers in one process with the
dp replicas' batches in one (``per_device_train_batch_size * dp``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

VOCAB = 48
WORDS = [f"w{i}" for i in range(VOCAB - 3)]
_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def tokenizer() -> Any:
    """A word-level tokenizer: ``[PAD]`` 0, ``[EOS]`` 1, ``[UNK]`` 2, then ``w0 ...``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[EOS]": 1, "[UNK]": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]"
    )


def model(cls: type | None = None) -> Any:
    """The tiny Llama, fp32, fixed init (the same in every process)."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, use_cache=False, pad_token_id=0,
        eos_token_id=1, bos_token_id=None, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return (cls or transformers.LlamaForCausalLM)(cfg)


def sft_dataset(n: int = 24) -> Any:
    """Pre-tokenized documents of 3-20 words (seeded)."""
    import datasets

    gen = torch.Generator().manual_seed(5)
    rows = []
    for _ in range(n):
        length = int(torch.randint(3, 21, (1,), generator=gen))
        rows.append(torch.randint(3, VOCAB, (length,), generator=gen).tolist())
    return datasets.Dataset.from_dict({"input_ids": rows})


def prompt_dataset(n: int = 16) -> Any:
    """Text prompts of 3-6 words (seeded)."""
    import datasets

    gen = torch.Generator().manual_seed(6)
    prompts = []
    for _ in range(n):
        length = int(torch.randint(3, 7, (1,), generator=gen))
        prompts.append(" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (length,))))
    return datasets.Dataset.from_dict({"prompt": prompts})


def _common_args(
    out: str, steps: int, per_device: int, ga: int, bf16: bool | None = False
) -> dict[str, Any]:
    """The arguments every run shares; ``bf16=None`` leaves the config's own default (TRL's
    ``SFTConfig`` / ``GRPOConfig``: ``bf16=True``, the forward under CPU autocast)."""
    args = {
        "output_dir": out, "max_steps": steps, "per_device_train_batch_size": per_device,
        "gradient_accumulation_steps": ga, "learning_rate": 0.5, "optim": "sgd",
        "lr_scheduler_type": "constant",
        "logging_steps": 1, "save_strategy": "no", "report_to": "none", "use_cpu": True,
        "disable_tqdm": True, "seed": 0, "bf16": bf16, "dataloader_num_workers": 0,
    }  # fmt: skip
    if bf16 is None:
        del args["bf16"]
    return args


LOGGED = ("loss", "entropy", "reward")


def _result(trainer: Any) -> dict[str, Any]:
    """Per step: the logged loss (and GRPO's entropy / reward); the final weights and how far
    they moved from the initial ones (a parity test on weights that never moved proves nothing)."""
    logs = {k: [h[k] for h in trainer.state.log_history if k in h] for k in LOGGED}
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    init = model().state_dict()
    moved = max(float((weights[k] - init[k]).abs().max()) for k in init)
    return {"logs": logs, "losses": logs["loss"], "weights": weights, "moved": moved}


def run_sft(
    cp_size: int | None,
    per_device: int,
    steps: int,
    ga: int,
    packed: bool = True,
    n: int = 24,
    *,
    bf16: bool = False,
) -> dict[str, Any]:
    """SFT (TRL) with padding-free packing (or padded rows) on ``n`` documents; ``steps=-1``:
    one whole epoch (its last batch partial when the rows do not fill it); ``cp_size=None``: the
    stock trainer. ``bf16``: ``SFTConfig``'s default precision (``bf16=True``), else fp32."""
    from trl import SFTConfig, SFTTrainer

    from cpshard.integrations.trl_trainers import CPSFTTrainer

    with tempfile.TemporaryDirectory() as out:
        pack = {"packing": True, "max_length": 24} if packed else {"max_length": 24}
        args = SFTConfig(**_common_args(out, steps, per_device, ga, None if bf16 else False),
                         num_train_epochs=1, **pack)  # fmt: skip
        assert args.bf16 is bf16
        kw = {"model": model(), "args": args, "train_dataset": sft_dataset(n),
              "processing_class": tokenizer()}  # fmt: skip
        trainer = SFTTrainer(**kw) if cp_size is None else CPSFTTrainer(**kw, cp_size=cp_size)
        trainer.train()
        return _result(trainer)


def uneven_dataset() -> Any:
    """8 rows: rows 0 and 1 of different lengths, rows 2..7 all of 9 tokens (seeded); in
    sequential batches of 2, only the first batch needs padding."""
    import datasets

    gen = torch.Generator().manual_seed(7)
    lengths = [5, 9, 9, 9, 9, 9, 9, 9]
    rows = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]
    return datasets.Dataset.from_dict({"input_ids": rows})


def _lm_collator(tok: Any, scored_pads: bool) -> Any:
    """transformers' causal-LM collator; ``scored_pads=False``: no pad has a target (the label
    of the first token after left padding set to -100, the fix the CP trainer names)."""
    from transformers import DataCollatorForLanguageModeling

    base = DataCollatorForLanguageModeling(tok, mlm=False)
    if scored_pads:
        return base

    def collate(rows: list[Any]) -> dict[str, Any]:
        out = base(rows)
        out["labels"][:, 1:][out["attention_mask"][:, :-1] == 0] = -100
        return dict(out)

    return collate


def trainer_for(
    cp_size: int | None, per_device: int, steps: int, ga: int, out: str, side: str = "right",
    scored_pads: bool = True, data: str = "sft", bf16: bool = False,
) -> Any:  # fmt: skip
    """Plain ``transformers.Trainer`` (or ``CPTrainer``) on padded rows (``side`` padding,
    labels -100 at pads); ``data="uneven"``: :func:`uneven_dataset` in sequential order;
    ``bf16``: ``TrainingArguments(bf16=True)``."""
    from transformers import Trainer, TrainingArguments

    from cpshard.integrations.hf_trainer import CPTrainer

    order = {"train_sampling_strategy": "sequential"} if data == "uneven" else {}
    args = TrainingArguments(**_common_args(out, steps, per_device, ga, bf16), **order)
    tok = tokenizer()
    tok.padding_side = side
    kw = {"model": model(), "args": args,
          "train_dataset": uneven_dataset() if data == "uneven" else sft_dataset(),
          "data_collator": _lm_collator(tok, scored_pads)}  # fmt: skip
    return Trainer(**kw) if cp_size is None else CPTrainer(**kw, cp_size=cp_size)


def run_trainer(cp_size: int | None, per_device: int, steps: int, ga: int, side: str = "right",
                scored_pads: bool = True, *, bf16: bool = False) -> dict[str, Any]:  # fmt: skip
    """Train :func:`trainer_for` and return its losses and weights."""
    with tempfile.TemporaryDirectory() as out:
        trainer = trainer_for(cp_size, per_device, steps, ga, out, side, scored_pads, bf16=bf16)
        trainer.train()
        return _result(trainer)


def _reward(completions: list[str], **_: Any) -> list[float]:
    """Share of words with an even index: deterministic, varied between completions."""
    out = []
    for text in completions:
        words = text.split()
        out.append(sum(int(w[1:]) % 2 == 0 for w in words if w[1:].isdigit()) / max(len(words), 1))
    return out


def seeded_generate_llama() -> type:
    """A Llama whose ``generate`` samples every row from its own generator.

    The seed of a row is its prompt and its occurrence among equal prompts of the call, plus
    ``salt``: rows are the same whatever the batch they are generated in (so one process and
    the dp replicas generate the same completions), and a rank with another ``salt`` (a CP
    follower) generates different ones unless the CP trainer broadcasts its leader's.
    """
    import transformers

    class SeededGenerateLlama(transformers.LlamaForCausalLM):  # type: ignore[misc]
        salt = 0

        @torch.no_grad()
        def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     generation_config: Any = None, **_: Any) -> torch.Tensor:  # fmt: skip
            new = generation_config.max_new_tokens
            seen: dict[tuple[int, ...], int] = {}
            rows = []
            for ids, mask in zip(input_ids.tolist(), attention_mask.tolist(), strict=True):
                prompt = tuple(i for i, m in zip(ids, mask, strict=True) if m)
                k = seen[prompt] = seen.get(prompt, -1) + 1
                gen = torch.Generator().manual_seed(hash((prompt, k, self.salt)) % (2**31))
                rows.append(torch.randint(3, VOCAB, (new,), generator=gen))
            return torch.cat([input_ids, torch.stack(rows).to(input_ids.device)], dim=1)

    return SeededGenerateLlama


def run_grpo(
    cp_size: int | None, per_device: int, steps: int, salt: int = 0, *, bf16: bool = False
) -> dict[str, Any]:
    """GRPO (TRL), G=2, 6 new tokens, dapo loss; ``cp_size=None``: the stock trainer.
    ``bf16``: ``GRPOConfig``'s default precision (``bf16=True``), else fp32."""
    from trl import GRPOConfig, GRPOTrainer

    from cpshard.integrations.trl_trainers import CPGRPOTrainer

    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            **_common_args(out, steps, per_device, 1, None if bf16 else False), num_generations=2,
            max_completion_length=6, mask_truncated_completions=False, beta=0.0,
            loss_type="dapo", scale_rewards="group", shuffle_dataset=True,
        )  # fmt: skip
        assert args.bf16 is bf16
        policy = model(seeded_generate_llama())
        policy.salt = salt
        kw = {"model": policy, "reward_funcs": _reward, "args": args,
              "train_dataset": prompt_dataset(), "processing_class": tokenizer()}  # fmt: skip
        trainer = GRPOTrainer(**kw) if cp_size is None else CPGRPOTrainer(**kw, cp_size=cp_size)
        trainer.train()
        return _result(trainer)


@contextlib.contextmanager
def accelerate_on_this_group(mesh: DeviceMesh) -> Iterator[None]:
    """Let accelerate join the ranks' existing gloo group (as under torchrun), then forget it.

    accelerate reads the launcher's environment; the pool's ranks are not launched by torchrun,
    so the variables are set for the span of the block and accelerate's singleton state is reset
    on both sides (the pool's processes run other tests afterwards).
    """
    from accelerate.state import AcceleratorState

    rank, world = mesh.get_local_rank(), mesh.size()
    saved = {k: os.environ.get(k) for k in _ENV}
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT="29500",
    )  # fmt: skip
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        yield
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _runner(what: str) -> Callable[..., dict[str, Any]]:
    """``"sft"``, ``"trainer"``, ``"grpo"``, each also as ``"<name>:bf16"`` (bf16 precision)."""
    name, _, precision = what.partition(":")
    fn = {"sft": run_sft, "trainer": run_trainer, "grpo": run_grpo}[name]
    return functools.partial(fn, bf16=precision == "bf16")


def on_ranks(mesh: DeviceMesh, what: str, *args: Any) -> dict[str, Any] | None:
    """Run ``run_<what>(*args)`` on this rank's group; rank 0 returns the result."""
    fn = _runner(what)
    with accelerate_on_this_group(mesh):
        if what.startswith(
            "grpo"
        ):  # CP followers generate differently unless the leader's are broadcast
            args = (*args, mesh.get_local_rank() % args[0])
        res = fn(*args)
    return res if mesh.get_local_rank() == 0 else None


def in_one_process(what: str, *args: Any) -> dict[str, Any]:
    """The stock trainer in this process (no process group), accelerate state reset after."""
    from accelerate.state import AcceleratorState

    fn = _runner(what)
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        return fn(None, *args)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def bad_cp_size_raises_on_every_rank(mesh: DeviceMesh) -> str:
    """cp_size=3 on 4 ranks: the same ValueError on every rank, before any collective."""
    import pytest

    with accelerate_on_this_group(mesh), pytest.raises(ValueError, match="cp_size=3") as info:
        run_trainer(3, 2, 1, 1)
    return str(info.value)


def ddp_over_a_subgroup_raises(mesh: DeviceMesh) -> str:
    """A DDP whose group is a pair of the 4 ranks (not the world): named before any step."""
    import pytest
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from cpshard._comm import dp_cp_mesh
    from cpshard.integrations.hf_trainer import CPSetup, check_ddp_over_world

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both
    ddp = DistributedDataParallel(torch.nn.Linear(2, 2), process_group=pairs[dist.get_rank() // 2])
    cp = CPSetup(2, 4, dist.get_rank(), dp_cp_mesh("cpu", 2), 0, "all_gather", "auto")
    with pytest.raises(ValueError, match="process_group.*whole world \\(4 ranks\\)"):
        check_ddp_over_world(ddp, cp)
    world = DistributedDataParallel(torch.nn.Linear(2, 2))
    check_ddp_over_world(world, cp)  # the trainer's own DDP passes
    with pytest.raises(ValueError, match="model wrapper.*DistributedDataParallel over the world"):
        check_ddp_over_world(torch.nn.Linear(2, 2), cp)
    return "ok"


def scored_pads_raise_on_every_rank(mesh: DeviceMesh) -> tuple[str, int]:
    """dp=2 x cp=2, left padding with the stock collator: only replica 0's first batch has a
    scored pad (replica 1's rows are equally long), yet every rank raises the same error
    before the first optimizer step, the weights untouched.

    Returns:
        ``(message, scored pads in this rank's first batch)``.
    """
    import pytest

    from cpshard.integrations.hf_trainer import scored_pad_positions

    with accelerate_on_this_group(mesh), tempfile.TemporaryDirectory() as out:
        trainer = trainer_for(2, 2, 3, 1, out, "left", True, "uneven")
        first = next(iter(trainer.get_train_dataloader()))
        with pytest.raises(ValueError, match="would score .* padded position") as info:
            trainer.train()
        assert any(f.name == "get_batch_samples" for f in info.traceback)  # before the step
        assert trainer.state.global_step == 0
        init = model().state_dict()
        for name, w in trainer.model.state_dict().items():
            assert torch.equal(w, init[name]), name
    return str(info.value), len(scored_pad_positions(first))
