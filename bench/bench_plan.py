"""What the benchmark measures (full, --quick, --tiny) and what each run shares."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench_data import SHORT, Datasets, Shape, shape_tag
from bench_procs import Limits, Series
from bench_report import Figure


@dataclass(frozen=True)
class KernelCase:
    """`sdpa check` on a `dtype` export of `shape` vs torch's kernel; limit: the ratio."""

    shape: Shape
    dtype: str
    causal: bool
    limit: float | None

    @property
    def key(self) -> str:
        return f"kernel/{shape_tag(self.shape)}/{SHORT[self.dtype]}" + (
            "/causal" if self.causal else ""
        )


@dataclass(frozen=True)
class Plan:
    name: str
    kernel: tuple[KernelCase, ...]
    scale_lead: tuple[int, int]  # (B, H) of the per-score and memory inputs
    scale_embed: int
    lengths: tuple[int, ...]  # L = S of the per-score cost and the memory figures
    text_max_length: int  # compute --format json|yaml only at L ≤ this
    grad_shape: Shape
    manifest_count: int
    manifest_shape: Shape
    repeat: int  # alternated runs per timing figure
    startup_repeat: int

    def scale_shape(self, length: int) -> Shape:
        return (*self.scale_lead, length, self.scale_embed)


def _kernel(big: Shape, long: Shape) -> tuple[KernelCase, ...]:
    return (
        KernelCase(big, "float16", False, 1.5),
        KernelCase(big, "float32", False, 1.25),
        KernelCase(long, "float16", False, 1.4),
        KernelCase(big, "float16", True, None),
    )


FULL = Plan(
    name="full",
    kernel=_kernel((1, 8, 8192, 128), (1, 8, 16384, 64)),
    scale_lead=(1, 8),
    scale_embed=64,
    lengths=(1024, 2048, 4096, 8192, 16384),
    text_max_length=4096,
    grad_shape=(1, 8, 4096, 64),
    manifest_count=64,
    manifest_shape=(1, 4, 512, 64),
    repeat=5,
    startup_repeat=10,
)
QUICK = Plan(
    name="quick",
    kernel=_kernel((1, 2, 2048, 128), (1, 2, 4096, 64)),
    scale_lead=(1, 2),
    scale_embed=64,
    lengths=(256, 512, 1024, 2048, 4096),
    text_max_length=512,
    grad_shape=(1, 2, 2048, 64),
    manifest_count=64,
    manifest_shape=(1, 2, 256, 64),
    repeat=3,
    startup_repeat=10,
)
TINY = Plan(  # a smoke run of the harness itself, a minute or two
    name="tiny",
    kernel=_kernel((1, 1, 512, 128), (1, 1, 1024, 64)),
    scale_lead=(1, 1),
    scale_embed=32,
    lengths=(64, 128, 256, 512, 1024),
    text_max_length=128,
    grad_shape=(1, 1, 512, 64),
    manifest_count=8,
    manifest_shape=(1, 1, 64, 32),
    repeat=2,
    startup_repeat=3,
)


def matcher(patterns: Sequence[str] | None) -> Callable[[str], bool]:
    """--only: glob patterns; one without wildcards matches anywhere in the key."""
    if not patterns:
        return lambda key: True
    globs = [p if any(c in p for c in "*?[") else f"*{p}*" for p in patterns]
    return lambda key: any(fnmatch.fnmatchcase(key, g) for g in globs)


@dataclass
class Context:
    """What every section needs: the sdpa executable, the inputs, the limits, the runs."""

    sdpa: str
    datasets: Datasets
    scratch: Path  # reports and --save files
    limits: Limits
    repeat: int
    have_torch: bool
    wanted: Callable[[str], bool]
    progress: Callable[[str], None]
    jobs: int | None = None  # sdpa check --jobs N, when given
    series: list[Series] = field(default_factory=list)  # every measurement, for --json

    def new_series(self, key: str, command: Sequence[str]) -> Series:
        series = Series(key, list(command))
        self.series.append(series)
        return series


@dataclass
class Section:
    """A section of the output: its table(s) and its figures against their targets."""

    title: str
    text: str
    figures: list[Figure] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
