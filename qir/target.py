"""The GPU a plan is compiled for: one `Target`, chosen once (the device's compute capability on
the cuda backend, `--arch` or `qir.compile(target=...)` elsewhere) and carried by the plan.

A target decides every arch-dependent lowering choice, and each choice keeps a host emulation,
so the host backend runs any target's kernels:
- `fp4_cvt`: E2M1 codes become f16 pairs in hardware (`cvt.rn.f16x2.e2m1x2`, arch-specific
  sm_100a and later): FP4 weights decode in k order and W4A4's GEMV multiplies f16 pairs;
  elsewhere codes go through E4M3 (pairs two apart) and W4A4 multiplies them as integers
  (PRMT + DP4A). The choice changes the kernel's algorithm, so the kernel's name says the
  target.
- `block_scaled_fp4_mma`: W4A4 GEMMs on `mma.sync ... kind::mxf4nvf4.block_scale` (sm_120a,
  sm_121a; ptxas refuses it elsewhere, sm_100a's is tcgen05's).
- `fp8_cvt` (sm_89 and later): FP8 codes convert in hardware. The helper picks the instruction
  by the arch a cubin is built for, with a bit-identical portable body (as for lop3 or dp4a),
  so it changes no algorithm and no kernel.
`smem_per_block` and `reference_gpu` are facts for the static cost table
(qir.cost.resources, qir.cost.gpus)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from qir.errors import UsageError

_ARCH = re.compile(r"sm_(\d+)([af]?)")
KB = 1024
# Most shared memory one block may use (opting in beyond 48 KB), by compute capability (CUDA
# C++ Programming Guide, "Technical Specifications per Compute Capability").
_SMEM_PER_BLOCK = {80: 163 * KB, 86: 99 * KB, 87: 163 * KB, 89: 99 * KB, 90: 227 * KB}
_SMEM_PER_BLOCK |= {100: 227 * KB, 103: 227 * KB, 110: 227 * KB, 120: 99 * KB, 121: 99 * KB}
# The GPU whose budget the cost table shows for a compute capability (its fastest memory).
_REFERENCE_GPU = {80: "A100", 90: "H200", 100: "B200", 120: "RTX 5090"}


@dataclass(frozen=True)
class Target:
    arch: str  # as NVRTC spells it: "sm_90", "sm_120a"

    def __post_init__(self) -> None:
        m = _ARCH.fullmatch(self.arch)
        if m is None or int(m.group(1)) < 80:
            raise UsageError(
                f"arch {self.arch!r}: expected sm_80 or later, as NVRTC spells it (sm_80, sm_90, "
                "sm_100a, sm_120a: an a or f suffix enables an arch's own instructions)"
            )

    @classmethod
    def of_capability(cls, capability: str | int) -> Target:
        """The target of a device of compute capability "90", "120" (as CuPy spells it): from
        Blackwell on with the arch's own instructions (a cubin for sm_120a runs on 12.0 only,
        which is this device)."""
        cc = int(capability)
        return cls(f"sm_{cc}{'a' if cc >= 100 else ''}")

    @property
    def capability(self) -> int:
        """The compute capability as NVRTC numbers it: 90 for sm_90 and sm_90a."""
        return int(self.arch[3:].rstrip("af"))

    @property
    def specific(self) -> bool:
        """Whether the arch's own (a) or its family's (f) instructions are enabled."""
        return self.arch[-1] in "af"

    @property
    def fp8_cvt(self) -> bool:
        return self.capability >= 89

    @property
    def fp4_cvt(self) -> bool:
        # __CUDA_ARCH_FAMILY_SPECIFIC__ in 1000..1299: sm_100a/f, sm_103a, sm_110a, sm_120a/f, ...
        return self.specific and 100 <= self.capability < 130

    @property
    def block_scaled_fp4_mma(self) -> bool:
        return self.arch in ("sm_120a", "sm_121a")

    @property
    def smem_per_block(self) -> int | None:
        return _SMEM_PER_BLOCK.get(self.capability)

    @property
    def reference_gpu(self) -> str | None:
        """The GPU of the cost table for this target (qir.cost.gpus), if qir has its facts."""
        return _REFERENCE_GPU.get(self.capability)

    @property
    def tag(self) -> str:
        """How kernel names spell it: "sm120a"."""
        return self.arch.replace("_", "")

    @property
    def features(self) -> tuple[str, ...]:
        """What the lowering may use, as the plan JSON and the dump list it."""
        return tuple(
            name
            for name, has in (
                ("fp8 conversion", self.fp8_cvt),
                ("fp4 conversion", self.fp4_cvt),
                ("block-scaled fp4 mma", self.block_scaled_fp4_mma),
            )
            if has
        )


# Without a GPU to take it from and no --arch: Hopper (H100/H200), the datacenter GPU today.
DEFAULT = Target("sm_90")
