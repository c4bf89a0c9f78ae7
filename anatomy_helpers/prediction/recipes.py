"""Precision recipes of a Hugging Face fine-tune, named: the dtypes of its weights, gradients and optimizer state,
and what its matmuls run in, as the people who fine-tune on a given GPU set them up.

A :class:`~anatomy_helpers.prediction.hf_step.FineTune` says its recipe through ``dtype`` (the weights'; LoRA: the
frozen base's), ``autocast`` and ``optimizer``; :func:`recipe_of` names it and counts its model states' bytes per
parameter from the dtypes alone (:func:`state_bytes`), so a test can check them against a dry run's categories.
:data:`RECIPES` are the ones a prediction can be asked for by name (the CLI's ``--recipe``):

* ``pure-bf16``: bf16 weights, bf16 gradients, bf16 AdamW moments (2 + 2 + 4 = 8 B per trained parameter);
* ``bf16-mixed``: fp32 master weights, fp32 gradients and AdamW moments (4 + 4 + 8 = 16 B), bf16 autocast;
* ``fp16-mixed``: the same with fp16 autocast and a GradScaler, the recipe of a GPU without native bf16 (a T4);
  a LoRA fine-tune keeps its frozen base in fp16 there (2 B per frozen parameter), its adapters fp32;
* ``fp32``: everything fp32, no autocast (16 B);
* ``adamw-8bit``: bitsandbytes' AdamW8bit (one byte per moment and a float32 scale per block of 256): a dry run
  cannot follow it (it reads each block's absolute maximum, a value), so it is refused by name (:data:`REFUSED`);
* ``qlora``: a 4-bit base (bitsandbytes' ``Linear4bit`` under LoRA adapters): refused by name too.

:func:`device_recipe` is the one place a device picks the recipe: bf16 where it is native (or the device's
capability is unknown), fp16 autocast over fp32 master weights with a GradScaler below compute capability 8.0, the
reason being fit.py's :func:`~anatomy_helpers.prediction.fit.precision_note` (the course GPT's note).

Bytes everywhere unless a name says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import torch

from .devices import Device
from .fit import precision_note

#: Recipes a dry run cannot follow, and why (what each would need that a dry run has not got).
REFUSED = {
    "adamw-8bit": "bitsandbytes' AdamW8bit quantizes each block of 256 values by its absolute maximum (a value, "
    "which a dry run on fake tensors has not got), through kernels with no checked fake implementation",
    "qlora": "bitsandbytes' Linear4bit quantizes the base weights from their values (each block's absolute "
    "maximum) when the model is moved to the GPU; a dry run on fake tensors has no values and no checked fake "
    "kernel for the 4-bit matmul",
}

#: name -> (weights' dtype, autocast): the recipes a prediction runs, by name.
RECIPES = {
    "pure-bf16": ("bfloat16", None),
    "bf16-mixed": ("float32", "bfloat16"),
    "fp16-mixed": ("float32", "float16"),
    "fp32": ("float32", None),
}
#: Bytes of each AdamW8bit moment per parameter: one uint8 and a quarter of a float32 scale per 256 (bitsandbytes).
ADAM_8BIT_MOMENT = Fraction(1) + Fraction(4, 256)
_STATE_BUFFERS = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2}


@dataclass(frozen=True)
class Recipe:
    """A fine-tune's precision recipe: its name, and the bytes of model states per trained and per frozen
    parameter (weights + gradients + optimizer state; frozen: the weights alone)."""

    name: str
    trained: Fraction
    frozen: Fraction
    note: str

    def text(self) -> str:
        """One line: the recipe and its bytes per parameter."""
        per = f"{_num(self.trained)} B per trained parameter"
        if self.frozen:
            per += f", {_num(self.frozen)} B per frozen one"
        return f"recipe: {self.name} ({per}: {self.note})"


def _num(x: Fraction) -> str:
    return str(int(x)) if x.denominator == 1 else f"{float(x):.3g}"


def _size(dtype: str) -> int:
    return getattr(torch, dtype).itemsize


def state_bytes(ft) -> tuple[Fraction, Fraction]:
    """(bytes per trained parameter, bytes per frozen parameter) of ``ft``'s model states, from the dtypes alone:
    a weight and its gradient in the weight's dtype and the optimizer's buffers in it too (torch's optimizers keep
    their state in the parameter's dtype; AdamW8bit: :data:`ADAM_8BIT_MOMENT` per moment). LoRA adapters are
    fp32 whatever the base (peft's ``autocast_adapter_dtype`` casts bf16 and fp16 adapters up)."""
    weight = _size(ft.dtype)
    trained_weight = 4 if ft.method == "lora" else weight
    if ft.optimizer == "adamw8bit":
        state = 2 * ADAM_8BIT_MOMENT
    else:
        state = Fraction(_STATE_BUFFERS[ft.optimizer] * trained_weight)
    return Fraction(2 * trained_weight) + state, Fraction(weight)


def recipe_of(ft) -> Recipe:
    """The named recipe ``ft`` runs, with its bytes per parameter (:func:`state_bytes`)."""
    trained, frozen = state_bytes(ft)
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
    w = short[ft.dtype]
    if ft.method == "lora":
        name = f"{w} frozen base, fp32 LoRA adapters"
    elif ft.autocast is None:
        name = "fp32" if ft.dtype == "float32" else f"pure {w}"
    else:
        name = f"{short[ft.autocast]} autocast over {w} master weights"
    if ft.method == "lora" and ft.autocast:
        name += f", {short[ft.autocast]} autocast"
    if ft.autocast == "float16":
        name += " + GradScaler"
    state = (
        "AdamW8bit moments" if ft.optimizer == "adamw8bit" else f"{ft.optimizer} state, in the trained weights' dtype"
    )
    note = f"weight + gradient + {state}"
    if ft.autocast == "float16":
        note += "; the GradScaler's state is two 4-byte scalars (on CUDA only: not in the CPU dry run)"
    if ft.method != "full":
        return Recipe(name, trained, frozen, note)
    return Recipe(name, trained, Fraction(0), note)


def device_recipe(method: str, device: Device) -> tuple[str, str | None, str]:
    """(weights' dtype, autocast, reason) of the recipe people run on ``device``: pure bf16 where bf16 is native
    (or the capability is unknown); below compute capability 8.0, fp16 autocast with a GradScaler over fp32
    master weights (a LoRA fine-tune: its frozen base in fp16). The reason is :func:`precision_note`'s."""
    if device.mixed_precision == "bfloat16":
        return "bfloat16", None, ""
    note = precision_note("bfloat16", None, device)
    base = "float16" if method == "lora" else "float32"
    what = "the frozen base in fp16 and fp32 adapters" if method == "lora" else "fp32 weights and optimizer state"
    return base, "float16", f"{note}: predicted with fp16 autocast + GradScaler, {what} (the recipe run there)"
