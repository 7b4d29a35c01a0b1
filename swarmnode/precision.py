"""Where a node computes and in what precision: `--device` and `--dtype`.

Weights, gradients and optimizer state stay float32 ("master weights") whatever a node computes in: a
bfloat16 or float16 node runs its forward and backward passes under `torch.autocast`, so averaging, state
transfer and CheckFree rebuilds always see float32, and a swarm may mix nodes of different precision and
device. float16 has a narrow range, so a float16 node scales its backward pass (`LossScaler`); every stage
scales and unscales its own, so the gradients that travel between nodes are at their true scale.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from swarmnode.runspec import COMPUTE_DTYPE_NAMES

COMPUTE_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in COMPUTE_DTYPE_NAMES}
DEVICE_CHOICES = "auto, cpu, cuda, cuda:N or mps"
_DEVICE = re.compile(r"auto|cpu|mps|cuda(:\d{1,3})?")


class PrecisionError(ValueError):
    """A device or dtype this machine or this torch build cannot use."""


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype of a `--dtype` name."""
    if name not in COMPUTE_DTYPES:
        raise PrecisionError(f"unknown dtype {name!r}: choose one of {', '.join(COMPUTE_DTYPES)}")
    return COMPUTE_DTYPES[name]


def resolve_device(name: str) -> torch.device:
    """The device `--device NAME` means here: `auto` is the first CUDA device when there is one, else the
    CPU. A device this machine lacks is an error that says what is missing."""
    if not _DEVICE.fullmatch(name):
        raise PrecisionError(f"unknown device {name!r}: choose {DEVICE_CHOICES}")
    if name == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            build = "without CUDA" if torch.version.cuda is None else f"with CUDA {torch.version.cuda}"
            raise PrecisionError(
                f"device {name!r}: no CUDA device is available (torch {torch.__version__} built {build})"
            )
        index = int(name.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            count = torch.cuda.device_count()
            raise PrecisionError(f"device {name!r}: this machine has {count} CUDA device(s)")
        return torch.device("cuda", index)
    if name == "mps" and not torch.backends.mps.is_available():
        raise PrecisionError("device 'mps': Apple's Metal backend is not available on this machine")
    return torch.device(name)


@dataclass(frozen=True)
class Precision:
    """A node's compute device and dtype (float32 master weights in every case)."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.dtype not in COMPUTE_DTYPES.values():
            raise PrecisionError(f"unsupported compute dtype {self.dtype}")

    @classmethod
    def parse(cls, device: str, dtype: str) -> Precision:
        return cls(resolve_device(device), parse_dtype(dtype))

    @property
    def mixed(self) -> bool:
        return self.dtype != torch.float32

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Run the enclosed forward pass in this precision (float32: as written)."""
        if not self.mixed:
            yield
            return
        with torch.autocast(self.device.type, dtype=self.dtype):
            yield

    def synchronize(self) -> None:
        """Wait for the work queued on this device (a CUDA or Metal kernel runs after its call returns, so a
        job timed without this is charged to the next one). Nothing to wait for on the CPU."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elif self.device.type == "mps":
            torch.mps.synchronize()

    def scaler(self) -> LossScaler:
        """The loss scaler for this precision: dynamic for float16, a constant 1 otherwise."""
        return LossScaler(dynamic=self.dtype == torch.float16)


class LossScaler:
    """Dynamic loss scaling for float16 backward passes, one per optimizer.

    Backward passes multiply the incoming gradient by `scale`; the optimizer step divides it out
    (`StageOptimizer.step(grad_scale=1 / scale)`); `update` halves the scale after a step whose
    gradients overflowed (the optimizer skips that step, its norm being non-finite) and doubles it after
    `growth_interval` clean steps. The scale changes only between steps, so the microbatches of one step
    share it.
    """

    def __init__(
        self,
        dynamic: bool,
        initial: float = 2.0**12,
        growth_interval: int = 200,
        minimum: float = 1.0,
        maximum: float = 2.0**24,
    ) -> None:
        if not 0 < minimum <= initial <= maximum or growth_interval < 1:
            raise PrecisionError("loss scaler bounds must satisfy 0 < minimum <= initial <= maximum")
        self.dynamic = dynamic
        self.scale = initial if dynamic else 1.0
        self.growth_interval = growth_interval
        self.minimum, self.maximum = minimum, maximum
        self.overflows = 0
        self._clean = 0

    def update(self, overflowed: bool) -> None:
        """After a step: back off on an overflow, grow after enough clean steps."""
        if not self.dynamic:
            return
        if overflowed:
            self.overflows += 1
            self.scale = max(self.minimum, self.scale / 2)
            self._clean = 0
            return
        self._clean += 1
        if self._clean >= self.growth_interval:
            self.scale = min(self.maximum, self.scale * 2)
            self._clean = 0


def wire_dtypes(run_dtype: str) -> tuple[torch.dtype, torch.dtype]:
    """How a run's activations and gradients travel between nodes: in the run's dtype, except that a
    float16 run sends gradients as float32 (unscaled gradients are often below float16's range)."""
    activations = parse_dtype(run_dtype)
    return activations, (torch.float32 if activations == torch.float16 else activations)


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every value of `tensor` is finite (an empty tensor's are; integers always are), from its least
    and greatest value: one pass that allocates nothing the tensor's size, where `isfinite(t).all()` builds
    a mask as large as it (a llama-124m stage's 31M parameters on one idle thread: 15 ms of CPU against
    111 ms, `benchmarks/finite_check.py`)."""
    if tensor.numel() == 0 or not (tensor.is_floating_point() or tensor.is_complex()):
        return True
    least, greatest = torch.aminmax(tensor)  # NaN anywhere makes both NaN; complex tensors are refused
    return math.isfinite(least.item()) and math.isfinite(greatest.item())


class Overflow(ArithmeticError):
    """A float16 backward pass overflowed: the microbatch's gradient is lost and the step is skipped."""
