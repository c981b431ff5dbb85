"""The setting and the ground truth for the framework integration tests (issue 13).

A tiny GPT-2 built from a config (2 layers, width 64, vocab 256; no hub download, no dropout),
generated sequences of length 3-48, right-padded micro-batches with labels -100 on padding.
The ground truth is plain torch.optim.AdamW on each window's concatenated batch with the
token-mean loss (every predicted token of the window counts once), clipping at ``clip`` and a
linear warmup + linear decay schedule stepped once per update.
"""
from __future__ import annotations

import torch

VOCAB = 256
PAD = 0
IGNORE = -100


def tiny_gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=64, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2, pad_token_id=PAD)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config).float()


def make_sequences(count: int, seed: int = 0, min_len: int = 3, max_len: int = 48) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (count,), generator=gen)
    return [torch.randint(3, VOCAB, (int(n),), generator=gen) for n in lengths]


def collate(sequences: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Right-padded input_ids / attention_mask / labels (-100 on padding)."""
    width = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        input_ids[i, : len(s)] = s
        mask[i, : len(s)] = 1
    labels = input_ids.masked_fill(mask == 0, IGNORE)
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def predicted_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Tokens whose next token is predicted: the weight of a micro-batch's token-mean loss."""
    return int((batch["labels"][:, 1:] != IGNORE).sum())


def token_loss_sum(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(),
                                             batch["labels"][:, 1:].reshape(-1), ignore_index=IGNORE,
                                             reduction="sum")


def micro_batches(sequences: list[torch.Tensor], size: int) -> list[dict[str, torch.Tensor]]:
    return [collate(sequences[i : i + size]) for i in range(0, len(sequences), size)]


def linear_warmup_decay(optimizer, warmup: int, total: int):
    """LambdaLR with the shape of transformers.get_linear_schedule_with_warmup."""
    def factor(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        return max(0.0, (total - step) / max(1, total - warmup))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def ground_truth(sequences, micro_batch_size: int, k: int, *, lr: float, weight_decay: float, warmup: int,
                 clip: float | None, seed: int = 0, schedule_total: int | None = None, schedule_stride: int = 1):
    """(model, [lr used by each update]) after one torch.optim.AdamW update per window of k
    micro-batches (the last window partial), each on the window's token-mean loss. The schedule
    spans ``schedule_total`` steps (default: the number of windows) and takes ``schedule_stride``
    of them per update (accelerate steps a prepared scheduler once per process per update)."""
    model = tiny_gpt2(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    window_size = micro_batch_size * k
    windows = [sequences[i : i + window_size] for i in range(0, len(sequences), window_size)]
    scheduler = linear_warmup_decay(opt, warmup, schedule_total or len(windows))
    lrs = []
    for window in windows:
        opt.zero_grad()
        batch = collate(window)
        (token_loss_sum(model, batch) / predicted_tokens(batch)).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        for _ in range(schedule_stride):
            scheduler.step()
    return model, lrs
