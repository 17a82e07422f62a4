"""Facts about the GPUs qir targets, for the static cost table (qir.cost.resources): how many
warp instructions and bytes each can move per second, and what limits how many blocks an SM
holds. Data only; the maths lives where it is used.

Sources (public specifications; boost clocks, which is what a memory-bound decode kernel runs
at):
- A100 SXM4 80 GB: NVIDIA A100 datasheet (108 SMs, 1410 MHz boost, 2039 GB/s HBM2e) and the
  Ampere tuning guide (164 KB shared memory per SM, 163 KB per block).
- H100 SXM5: NVIDIA H100 datasheet / Hopper whitepaper (132 SMs, 1980 MHz max boost, 3.35 TB/s
  HBM3); H200 SXM: H200 datasheet (the same GH100 die and clocks, 4.8 TB/s HBM3e). Hopper
  tuning guide: 228 KB shared memory per SM, 227 KB per block.
- B200 (HGX, 1000 W): 148 SMs (two dies of 74), 1980 MHz boost (consistent with its 75 TFLOPS
  FP32 = 148 x 128 x 2 x 1.98 GHz), 8 TB/s HBM3e (NVIDIA HGX B200 specification). Blackwell
  tuning guide: 228 KB shared memory per SM, 227 KB per block.
- GeForce RTX 5090: NVIDIA product page (170 SMs, 2407 MHz boost, 1792 GB/s GDDR7 = 28 Gbps x
  512 bit); compute capability 12.0: 1536 threads (48 warps) and 100 KB shared memory per SM,
  99 KB per block.
Tensor cores (dense multiply-adds per SM per clock, from the quoted peak at the clock it is quoted
at): A100 312 TFLOPS FP16 with FP32 accumulation = 108 SMs x 1.41 GHz x 2 x 1024; H100/H200
989.4 TFLOPS = 132 x 1.83 GHz x 2 x 2048 (Hopper whitepaper; reached by wgmma, which qir does not
issue: mma.sync's own rate is not published); B200 2.25 PFLOPS dense FP16 (half the HGX B200
sheet's sparse 4.5) = 148 x ~1.86 GHz x 2 x 4096 (tcgen05's, likewise); RTX 5090 209.5 TFLOPS
FP16 with FP32 accumulation and 1676 TFLOPS dense FP4 = 170 x 2.407 GHz x 2 x 256 and x 2048
(GeForce Blackwell whitepaper). Shared memory per block is the target's (qir.target). Per-SM limits of compute capabilities
8.0, 9.0, 10.0 and 12.0 (CUDA C++ Programming Guide, "Technical Specifications per Compute
Capability"): 64K 32-bit registers, 4 warp schedulers,
at most 32 resident blocks, 255 registers per thread; registers are allocated per warp in units
of 256, shared memory in units of 128 bytes, and each block reserves 1 KB of shared memory for
the system.
"""

from __future__ import annotations

from dataclasses import dataclass

from qir.errors import UsageError
from qir.target import Target

# DRAM latency a load sees under load, for Little's law (bytes in flight = bandwidth x latency).
# ~600 ns on HBM GPUs under a bandwidth-bound load; the same figure is used for every GPU here.
MEMORY_LATENCY_S = 600e-9


@dataclass(frozen=True)
class Gpu:
    name: str
    arch: str  # the arch qir compiles for it
    sms: int
    schedulers_per_sm: int  # warp instructions issued per SM per clock
    clock_hz: float
    bandwidth: float  # DRAM bytes/s
    threads_per_sm: int
    blocks_per_sm: int
    registers_per_sm: int  # 32-bit
    smem_per_sm: int  # bytes usable by blocks
    # Dense tensor-core multiply-adds per SM per clock: f16/bf16 operands with fp32
    # accumulation, and block-scaled FP4 (0: the GPU has none, or qir has no figure).
    f16_fma_per_clock: int = 0
    e2m1_fma_per_clock: int = 0
    smem_reserved_per_block: int = 1024
    register_unit: int = 256  # registers per warp are allocated in these units
    smem_unit: int = 128

    @property
    def target(self) -> Target:
        return Target(self.arch)

    @property
    def smem_per_block(self) -> int | None:
        return self.target.smem_per_block

    @property
    def warp_instructions_per_s(self) -> float:
        return self.sms * self.schedulers_per_sm * self.clock_hz

    def instructions_per_bytes(self, nbytes: int = 512) -> float:
        """Warp instructions the GPU can issue in the time its DRAM moves `nbytes`: the most a
        kernel can spend per `nbytes` of weights and still stream them at full bandwidth."""
        return self.warp_instructions_per_s / self.bandwidth * nbytes

    def bytes_in_flight_per_sm(self, latency_s: float = MEMORY_LATENCY_S) -> float:
        """Little's law: the bytes each SM must have requested and not yet received to keep the
        DRAM busy (bandwidth x latency, spread over the SMs)."""
        return self.bandwidth * latency_s / self.sms


KB = 1024
_DATACENTER = {"blocks_per_sm": 32, "registers_per_sm": 65536}
GPUS: dict[str, Gpu] = {
    g.name: g
    for g in (
        Gpu(
            "A100",
            "sm_80",
            sms=108,
            schedulers_per_sm=4,
            clock_hz=1.41e9,
            bandwidth=2.039e12,
            threads_per_sm=2048,
            smem_per_sm=164 * KB,
            f16_fma_per_clock=1024,
            **_DATACENTER,
        ),
        Gpu(
            "H100",
            "sm_90",
            sms=132,
            schedulers_per_sm=4,
            clock_hz=1.98e9,
            bandwidth=3.35e12,
            threads_per_sm=2048,
            smem_per_sm=228 * KB,
            f16_fma_per_clock=2048,
            **_DATACENTER,
        ),
        Gpu(
            "H200",
            "sm_90",
            sms=132,
            schedulers_per_sm=4,
            clock_hz=1.98e9,
            bandwidth=4.8e12,
            threads_per_sm=2048,
            smem_per_sm=228 * KB,
            f16_fma_per_clock=2048,
            **_DATACENTER,
        ),
        Gpu(
            "B200",
            "sm_100a",
            sms=148,
            schedulers_per_sm=4,
            clock_hz=1.98e9,
            bandwidth=8.0e12,
            threads_per_sm=2048,
            smem_per_sm=228 * KB,
            f16_fma_per_clock=4096,
            **_DATACENTER,
        ),
        Gpu(
            "RTX 5090",
            "sm_120a",
            sms=170,
            schedulers_per_sm=4,
            clock_hz=2.407e9,
            bandwidth=1.792e12,
            threads_per_sm=1536,
            smem_per_sm=100 * KB,
            f16_fma_per_clock=256,
            e2m1_fma_per_clock=2048,
            **_DATACENTER,
        ),
    )
}


def gpus_for(arch: str) -> tuple[Gpu, ...]:
    """The GPUs of `arch` ("sm_90a" counts as sm_90), the target's reference GPU first (its
    fastest memory: qir.target)."""
    target = Target(arch)
    found = sorted(
        (g for g in GPUS.values() if g.target.capability == target.capability),
        key=lambda g: g.name != target.reference_gpu,
    )
    if not found:
        known = ", ".join(sorted({g.arch for g in GPUS.values()}))
        raise UsageError(f"arch {arch!r}: no GPU facts for it (known: {known})")
    return tuple(found)


def gpu(name: str) -> Gpu:
    try:
        return GPUS[name]
    except KeyError:
        raise UsageError(f"GPU {name!r}: unknown; known: {', '.join(GPUS)}") from None
