"""Per-parameter training-state memory (parameters, gradients, Adam states) and ZeRO sharding.

Sources:
  [ZERO] Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
         Models", SC'20, arXiv:1910.02054, sec. 3.1: mixed-precision Adam holds 2 (fp16 param) +
         2 (fp16 grad) + K = 12 (fp32 master param, momentum, variance) = 16 bytes per parameter;
         stage 1 shards the K part, stage 2 also the gradients, stage 3 also the parameters.
  [MEGM] NVIDIA/Megatron-LM megatron/training/theoretical_memory_usage.py (commit d98e8a64dd, in
         benchmarks/data/calibration.json): 18 bytes per parameter for bf16 training with fp32
         gradient accumulation (bf16 param 2 + fp32 grad 4 + fp32 master 4 + Adam m, v 8); with
         the distributed optimizer 6 + 12/d.
  [ADAM] Kingma & Ba, "Adam", ICLR 2015: two moment buffers (exp_avg, exp_avg_sq) per parameter,
         kept in fp32 by torch.optim.Adam/AdamW for fp32 parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "StateBytes",
    "training_state_breakdown",
    "training_state_bytes_per_param",
    "adam_state_bytes_per_param",
    "optimizer_state_bytes_per_param",
    "zero_sharded_bytes_per_param",
]

_PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each part of the training state on one unsharded device.

    Attributes:
        param: the parameter as the model computes with it.
        grad: its gradient (the reduction buffer).
        optimizer: optimizer states, including an fp32 master copy in mixed precision.
    """

    param: int
    grad: int
    optimizer: int

    @property
    def total(self) -> int:
        """Sum of the three parts."""
        return self.param + self.grad + self.optimizer


def _canon(mixed_precision: str) -> str:
    key = str(mixed_precision).removeprefix("torch.").lower()
    key = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}.get(key, key)
    if key not in _PRECISIONS:
        raise ValueError(
            f"unknown precision {mixed_precision!r}; use one of {', '.join(_PRECISIONS)}"
        )
    return key


def training_state_breakdown(mixed_precision: str = "fp32", fp32_grads: bool = True) -> StateBytes:
    """Per-parameter bytes of parameter, gradient and Adam state for a precision regime.

    * ``"fp32"``: param 4 + grad 4 + exp_avg 4 + exp_avg_sq 4 = 16 ([ADAM]).
    * ``"bf16"``/``"fp16"`` mixed precision: 16-bit param 2 + fp32 grad 4 + fp32 master 4 +
      exp_avg 4 + exp_avg_sq 4 = 18 ([MEGM]); with ``fp32_grads=False`` the gradient is 16-bit
      and the total is the ZeRO paper's 2 + 2 + 12 = 16 ([ZERO]).
    """
    key = _canon(mixed_precision)
    if key == "fp32":
        # [ADAM] fp32 param, fp32 grad, fp32 exp_avg and exp_avg_sq.
        return StateBytes(param=4, grad=4, optimizer=8)
    # [MEGM] / [ZERO]: 16-bit param, fp32 (or 16-bit) grad, K = 12 (fp32 master + m + v).
    return StateBytes(param=2, grad=4 if fp32_grads else 2, optimizer=12)


def training_state_bytes_per_param(mixed_precision: str = "fp32", fp32_grads: bool = True) -> int:
    """Total training-state bytes per parameter with Adam: 16 for "fp32", 18 for "bf16"/"fp16".

    See :func:`training_state_breakdown`; ``fp32_grads=False`` gives the ZeRO paper's 16 for
    mixed precision.
    """
    return training_state_breakdown(mixed_precision, fp32_grads).total


def adam_state_bytes_per_param(dtype: str = "fp32") -> int:
    """Total bytes per parameter of Adam training in ``dtype`` (param + grad + optimizer states).

    Same as :func:`training_state_bytes_per_param`: 16 for "fp32" (4 + 4 + 4 + 4, [ADAM]) and
    18 for "bf16" (2 + 4 + 4 + 4 + 4, [MEGM]). For the optimizer part alone see
    :func:`optimizer_state_bytes_per_param`.
    """
    return training_state_bytes_per_param(dtype)


def optimizer_state_bytes_per_param(mixed_precision: str = "fp32") -> int:
    """Bytes per parameter of the optimizer states alone (what ZeRO stage 1 shards).

    8 for "fp32" (exp_avg + exp_avg_sq); 12 for mixed precision (fp32 master + m + v, [ZERO]'s K).
    """
    return training_state_breakdown(mixed_precision).optimizer


def zero_sharded_bytes_per_param(
    mixed_precision: str = "fp32",
    zero_stage: int = 0,
    dp: int = 1,
    fp32_grads: bool = True,
) -> float:
    """Training-state bytes per parameter on one device under ZeRO ``zero_stage`` over ``dp`` ranks.

    Stage 0: nothing sharded; 1: optimizer / dp; 2: (grad + optimizer) / dp; 3: everything / dp
    ([ZERO] sec. 5). Stage 1 with bf16 gives Megatron's distributed optimizer 6 + 12/d ([MEGM]).
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        raise ValueError(f"dp must be an int >= 1, got {dp!r}")
    s = training_state_breakdown(mixed_precision, fp32_grads)
    param = s.param / dp if zero_stage >= 3 else float(s.param)
    grad = s.grad / dp if zero_stage >= 2 else float(s.grad)
    optimizer = s.optimizer / dp if zero_stage >= 1 else float(s.optimizer)
    return param + grad + optimizer
