"""accum_fused with the Hugging Face ``transformers.Trainer``.

The recipe: let the Trainer own the window (``gradient_accumulation_steps=k`` in
``TrainingArguments``) and give it an accum_fused optimizer in ``in_backward`` mode A
(``accumulation_steps=1``), plus ``AccumFusedCallback``::

    opt = accum_fused.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, in_backward=True)
    trainer = Trainer(model, args, ..., optimizers=(opt, None), callbacks=[AccumFusedCallback()])

The Trainer then keeps what it already does right: it counts the window's predicted tokens
(``num_items_in_batch``) and divides every micro-batch's summed loss by it, handles the partial
last window, builds its scheduler over updates and steps it once per update. The optimizer sums
the backward passes into fp32 buffers and frees ``.grad`` at once. What the Trainer would do
wrong with it -- clip ``.grad``, which in_backward has freed, so ``max_grad_norm`` would clip
nothing -- the callback moves into the optimizer's window clip; every other combination that
would train wrong raises at the start of training, naming the fix.

Under ``torchrun`` or ``accelerate launch`` the Trainer wraps the model in DistributedDataParallel
after the optimizer was built; the optimizer takes DDP's gradient sync over at the model's first
forward (accum_fused/ddp.py), and the Trainer's own scaling (``num_items_in_batch`` gathered over
the processes, the loss times their number) comes out as the global token mean.
"""
from __future__ import annotations

import math
from typing import Any

import transformers  # absolute: this module is accum_fused.integrations.transformers
from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from ..optim import SGD, Adam, AdamW, GradientAccumulator

_ACCUM_FUSED = (SGD, Adam, AdamW, GradientAccumulator)

__all__ = ["AccumFusedCallback", "unwrap_optimizer"]


def unwrap_optimizer(optimizer: Any):
    """The accum_fused optimizer inside the Trainer's wrappers (accelerate's
    ``AcceleratedOptimizer``), or None when there is none."""
    seen = set()
    while optimizer is not None and id(optimizer) not in seen:
        if isinstance(optimizer, _ACCUM_FUSED):
            return optimizer
        seen.add(id(optimizer))
        optimizer = getattr(optimizer, "optimizer", None)
    return None


def _counts_unpredicted_tokens(model: Any) -> bool:
    """Whether transformers' Trainer divides this causal LM's loss by too many tokens.

    The Trainer counts ``num_items_in_batch`` over ``labels[..., 1:]`` only when
    ``LOSS_MAPPING[model.loss_type]`` is ``ForCausalLMLoss``. Causal LMs whose class name does not
    contain a LOSS_MAPPING key (``GPT2LMHeadModel``: ``loss_type`` None) still compute
    ``ForCausalLMLoss`` (the ``loss_function`` fallback), which predicts ``labels[..., 1:]`` only,
    but the Trainer counts every label: each window's token mean is divided by its token count
    plus its number of sequences (measured: 3.5e-5 off the big batch after 5 AdamW updates, the
    plain torch.optim Trainer alike)."""
    if type(model).__name__ not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        return False
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    return LOSS_MAPPING.get(getattr(model, "loss_type", None)) is not ForCausalLMLoss


class AccumFusedCallback(transformers.TrainerCallback):
    """Checks an accum_fused optimizer against the TrainingArguments when training begins,
    moves the Trainer's clipping into the optimizer, and logs what the Trainer cannot see.

    - ``accumulation_steps > 1`` raises: the Trainer calls ``optimizer.step()`` once per window
      of ``gradient_accumulation_steps`` micro-batches and steps its scheduler with it, so an
      optimizer that accumulates again would update once per ``k * gradient_accumulation_steps``
      micro-batches (or, with ``gradient_accumulation_steps=1``, run the scheduler, clipping and
      ``max_steps`` per micro-batch).
    - ``in_backward=True`` with ``args.max_grad_norm > 0`` (the Trainer's default is 1.0): the
      Trainer would clip ``.grad``, which is None by then. The value becomes the optimizer's
      ``max_grad_norm`` (the window gradient's clip, what the Trainer meant) and the Trainer's
      is set to 0; both set and different raises.
    - A causal LM whose ``loss_type`` the Trainer does not recognise (``GPT2LMHeadModel``) raises:
      the Trainer would divide each window's summed loss by a token count that includes every
      sequence's first label, which is never predicted. Set ``model.loss_type = "ForCausalLM"``
      before building the Trainer.
    - ``in_backward=True`` with ``fp16=True`` (a GradScaler) raises: use ``bf16=True``.
    - DeepSpeed or FSDP (``args.deepspeed`` / ``args.fsdp``) raise ``NotImplementedError``; DDP
      (torchrun, accelerate launch) is supported: the optimizer takes DDP's sync over.
    - On every log: ``grad_norm`` (the Trainer measures ``.grad``, empty in in_backward) is
      replaced by the optimizer's ``last_grad_norm`` or removed, and ``update_count`` is added.
    """

    def __init__(self) -> None:
        self.optimizer = None  # the accum_fused optimizer, found at on_train_begin

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        # Everything is checked here, before the first micro-batch, so nothing trains wrong.
        opt = unwrap_optimizer(optimizer)
        if opt is None:
            raise TypeError(
                "AccumFusedCallback found no accum_fused optimizer in the Trainer: pass one with "
                "Trainer(..., optimizers=(accum_fused.AdamW(model.parameters(), ..., in_backward=True), None))"
            )
        if args.deepspeed or args.fsdp:
            raise NotImplementedError(
                f"{type(opt).__name__} under the HF Trainer with {'DeepSpeed' if args.deepspeed else 'FSDP'}: "
                "accum_fused supports the Trainer on one process and under DDP (torchrun / accelerate launch "
                "without DeepSpeed or FSDP; the optimizer then reduces the window itself once per update). "
                "DeepSpeed owns the optimizer step; the Trainer's FSDP is accelerate's plugin, which runs on GPUs "
                "only, where it has not run with accum_fused: for FSDP2 call torch's fully_shard in your own loop"
            )
        if opt.accumulation_steps > 1:
            raise ValueError(
                f"{type(opt).__name__}(accumulation_steps={opt.accumulation_steps}) under the HF Trainer "
                f"(gradient_accumulation_steps={args.gradient_accumulation_steps}): the Trainer already owns "
                "the window (it steps the optimizer, the scheduler and the clipping once per "
                "gradient_accumulation_steps micro-batches), so accumulating again is wrong. Give the window "
                "to the Trainer: TrainingArguments(gradient_accumulation_steps=<micro-batches per update>, e.g. "
                f"{max(opt.accumulation_steps, args.gradient_accumulation_steps)}) and an optimizer built with "
                "accumulation_steps=1, in_backward=True"
            )
        if opt.in_backward and getattr(optimizer, "scaler", None) is not None:
            raise ValueError(
                f"{type(opt).__name__}(in_backward=True) under TrainingArguments(fp16=True): the Trainer's "
                "GradScaler finds non-finite gradients by reading .grad, which in_backward frees inside backward. "
                "Use bf16=True (no scaler), or in_backward=False with accumulation_steps=1"
            )
        model = kwargs.get("model")
        if _counts_unpredicted_tokens(model):
            raise ValueError(
                f"the Trainer counts num_items_in_batch for {type(model).__name__} over every label, including "
                f"each sequence's first, which is never predicted (loss_type={getattr(model, 'loss_type', None)!r} is "
                "not a transformers LOSS_MAPPING key, so the Trainer does not know its loss shifts the labels): "
                "each window's token-mean loss would be divided by too many tokens. Set "
                "model.loss_type = \"ForCausalLM\" before building the Trainer"
            )
        if opt.in_backward and args.max_grad_norm and args.max_grad_norm > 0:
            if opt.max_grad_norm is None:
                opt.max_grad_norm = float(args.max_grad_norm)
            elif not math.isclose(opt.max_grad_norm, args.max_grad_norm):
                raise ValueError(
                    f"TrainingArguments(max_grad_norm={args.max_grad_norm}) and {type(opt).__name__}"
                    f"(max_grad_norm={opt.max_grad_norm}) disagree. With in_backward=True the optimizer clips "
                    "the window gradient (the Trainer would clip .grad, which in_backward has freed): set one "
                    "of them, or both to the same value"
                )
            # The Trainer reads args.max_grad_norm at every update: 0 turns its (empty) clip off.
            args.max_grad_norm = 0.0
        if opt.in_backward:
            # The Trainer starts with model.zero_grad(); in_backward's sums live in the optimizer, so
            # a window left open by an interrupted train() is discarded here as .grad is there.
            opt.zero_grad()
        self.optimizer = opt
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        opt = self.optimizer
        if opt is None or logs is None:
            return control
        # Trainer.log appended a copy of logs to log_history before calling us: correct both.
        for target in [logs] + state.log_history[-1:]:
            if opt.in_backward and "grad_norm" in target:
                # The Trainer measured .grad, which in_backward frees: its number is 0, not a norm.
                if opt.last_grad_norm is not None:
                    target["grad_norm"] = float(opt.last_grad_norm)
                else:
                    del target["grad_norm"]
            if "loss" in target or "grad_norm" in target or "learning_rate" in target:
                target["update_count"] = opt.update_count
        return control
