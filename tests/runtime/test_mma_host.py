"""The tensor-core and cp.async helpers of qir_mma.cuh on the host backend, against numpy and the
PTX ISA's fragment layouts (restated here from the ISA, independently of the emulation): mma
m16n8k16 (f16, bf16), ldmatrix x1/x2/x4 with and without .trans, cp.async with zero-fill and
wait groups. The same kernels run under the reverse schedule (same bytes) and the ASan/UBSan
build; on a GPU the PTX gives what the emulation gives on the same inputs."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from qir.codegen.gemm import mma_header
from qir.codegen.kernel import Kernel, KernelParam
from qir.runtime.backend import Backend, get_backend
from qir.runtime.host import HostBackend
from tests.conftest import ON_GPU
from tests.requires import requires

pytestmark = requires("gxx")

PRELUDE = (
    '#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <stdint.h>\n#include "qir_mma.cuh"\n'
)


def kernel(name: str, params: list[tuple[str, str]], body: str, threads: int = 32) -> Kernel:
    sig = ", ".join(f"{c_type} {n}" for n, c_type in params)
    kparams = tuple(KernelParam(n, c, "int" if c == "int" else "buffer") for n, c in params)
    source = f'{PRELUDE}\nextern "C" __global__ void {name}({sig}) {{\n{body}\n}}\n'
    return Kernel(name, source, kparams, (threads, 1, 1), (mma_header(),))


# -- the PTX ISA's layouts, lane by lane (groupID g = lane / 4, t = lane % 4) -----------------


def a_fragment(lane: int) -> list[tuple[int, int]]:
    """(row, col) of a0..a7: rows g (a0, a1, a4, a5) and g + 8, cols 2t + (i & 1) (+ 8 for i >= 4)."""
    g, t = divmod(lane, 4)
    return [(g + 8 * ((i // 2) % 2), 2 * t + (i & 1) + 8 * (i >= 4)) for i in range(8)]


def b_fragment(lane: int) -> list[tuple[int, int]]:
    """(k, n) of b0..b3: k = 2t + (i & 1) (+ 8 for i >= 2), n = g."""
    g, t = divmod(lane, 4)
    return [(2 * t + (i & 1) + 8 * (i >= 2), g) for i in range(4)]


def c_fragment(lane: int) -> list[tuple[int, int]]:
    """(row, col) of c0..c3: rows g (c0, c1) and g + 8, cols 2t + (i & 1)."""
    g, t = divmod(lane, 4)
    return [(g + 8 * (i >= 2), 2 * t + (i & 1)) for i in range(4)]


# One kernel holds every case (one g++ build, one sanitized build), picked by `which`; each case
# casts the byte buffers it is given. Blocks of 64 threads; single-warp cases leave warp 1 idle.
CASES = {
    "mma": 0,
    "ldmatrix": 1,
    "ldmatrix_mma": 2,
    "cp_async": 3,
    "no_wait": 4,
    "misaligned": 5,
    "nvf4": 6,
}
HELPERS = kernel(
    "mma_helpers",
    [("which", "int"), *((f"in{i}", "const uint8_t* __restrict__") for i in range(5))]
    + [(f"out{i}", "uint8_t* __restrict__") for i in range(2)],
    """
  const int t = threadIdx.x, lane = t % 32;
  if (which == 0) {
    // mma: one warp per tile; every lane loads its fragments straight from global memory by the
    // ISA's layouts (so the emulated exchange is checked against the ISA, not against itself).
    // in0..in3: per tile and lane 4 packed pairs of A, 2 of B (f16), then the same in bf16;
    // in4: 4 floats of C; out0, out1: D of the f16 and the bf16 product.
    const int at = (blockIdx.x * 2 + t / 32) * 32 + lane;
    const uint32_t* a16 = reinterpret_cast<const uint32_t*>(in0);
    const uint32_t* b16 = reinterpret_cast<const uint32_t*>(in1);
    const uint32_t* abf = reinterpret_cast<const uint32_t*>(in2);
    const uint32_t* bbf = reinterpret_cast<const uint32_t*>(in3);
    const float* c = reinterpret_cast<const float*>(in4);
    float* d16 = reinterpret_cast<float*>(out0);
    float* dbf = reinterpret_cast<float*>(out1);
    uint32_t av[4], bv[2];
    float cv[4], d[4];
    for (int i = 0; i < 4; ++i) cv[i] = c[at * 4 + i];
    for (int i = 0; i < 4; ++i) av[i] = a16[at * 4 + i];
    for (int i = 0; i < 2; ++i) bv[i] = b16[at * 2 + i];
    qir_mma_m16n8k16<__half>(d, av, bv, cv);
    for (int i = 0; i < 4; ++i) d16[at * 4 + i] = d[i];
    for (int i = 0; i < 4; ++i) av[i] = abf[at * 4 + i];
    for (int i = 0; i < 2; ++i) bv[i] = bbf[at * 2 + i];
    qir_mma_m16n8k16<__nv_bfloat16>(d, av, bv, cv);
    for (int i = 0; i < 4; ++i) dbf[at * 4 + i] = d[i];
  } else if (which == 1) {
    // Every ldmatrix form on four 8x8 matrices (in0) whose rows are 32 bytes apart: rows need
    // not be contiguous, each lane passes its own row's address. out0: each form's registers.
    __shared__ __align__(16) uint16_t s[4][8][16];
    if (t >= 32) return;
    const uint16_t* src = reinterpret_cast<const uint16_t*>(in0);
    uint32_t* out = reinterpret_cast<uint32_t*>(out0);
    for (int i = lane; i < 4 * 8 * 8; i += 32) s[i / 64][(i / 8) % 8][i % 8] = src[i];
    __syncwarp();
    const void* row = &s[lane / 8][lane % 8][0];
    uint32_t r1[1], r2[2], r4[4];
    int o = 0;
    qir_ldmatrix<1, false>(r1, row); out[o + lane] = r1[0]; o += 32;
    qir_ldmatrix<1, true>(r1, row); out[o + lane] = r1[0]; o += 32;
    qir_ldmatrix<2, false>(r2, row); for (int i = 0; i < 2; ++i) out[o + lane * 2 + i] = r2[i]; o += 64;
    qir_ldmatrix<2, true>(r2, row); for (int i = 0; i < 2; ++i) out[o + lane * 2 + i] = r2[i]; o += 64;
    qir_ldmatrix<4, false>(r4, row); for (int i = 0; i < 4; ++i) out[o + lane * 4 + i] = r4[i]; o += 128;
    qir_ldmatrix<4, true>(r4, row); for (int i = 0; i < 4; ++i) out[o + lane * 4 + i] = r4[i];
  } else if (which == 2) {
    // The GEMM's use: A [16][16] row-major (in0) and B as W[n][k] (in1) in shared memory, A by
    // ldmatrix.x4, B by ldmatrix.x2 on the n rows and by ldmatrix.x2.trans on a [k][n] copy;
    // out0: both products, 16x8 each.
    __shared__ __align__(16) __half as[16][24];
    __shared__ __align__(16) __half ws[8][24];
    __shared__ __align__(16) __half wt[16][16];
    if (t >= 32) return;
    const __half* a = reinterpret_cast<const __half*>(in0);
    const __half* w = reinterpret_cast<const __half*>(in1);
    float* out = reinterpret_cast<float*>(out0);
    for (int i = lane; i < 256; i += 32) as[i / 16][i % 16] = a[i];
    for (int i = lane; i < 128; i += 32) { ws[i / 16][i % 16] = w[i]; wt[i % 16][i / 16] = w[i]; }
    __syncwarp();
    uint32_t af[4], bf[2], bt[2];
    qir_ldmatrix<4, false>(af, &as[lane % 16][8 * (lane / 16)]);
    qir_ldmatrix<2, false>(bf, &ws[lane % 8][8 * ((lane / 8) % 2)]);
    qir_ldmatrix<2, true>(bt, &wt[lane % 16][0]);
    const float zero[4] = {0.f, 0.f, 0.f, 0.f};
    float d[4], e[4];
    qir_mma_m16n8k16<__half>(d, af, bf, zero);
    qir_mma_m16n8k16<__half>(e, af, bt, zero);
    const int g = lane / 4, q = lane % 4;
    for (int i = 0; i < 4; ++i) {
      const int at = (g + 8 * (i / 2)) * 8 + 2 * q + (i % 2);
      out[at] = d[i];
      out[128 + at] = e[i];
    }
  } else if (which == 3) {
    // cp.async, two wait groups: group 0 (.cg, 16 bytes, src-size t % 17) into s0, group 1
    // (.ca of 8 and 4 bytes with partial src-sizes) into 16-byte slots of s1 whose last 4
    // bytes stay as they were. After wait<1> only group 0 is complete, after wait<0> both.
    __shared__ __align__(16) uint8_t s0[64 * 16];
    __shared__ __align__(16) uint8_t s1[64 * 16];
    for (int i = t; i < 64 * 16; i += 64) s0[i] = s1[i] = 0xEE;
    __syncthreads();
    qir_cp_async_cg16(s0 + 16 * t, in0 + 16 * t, min(t % 17, 16));
    qir_cp_async_commit();
    qir_cp_async_ca<8>(s1 + 16 * t, in0 + 1024 + 8 * t, t % 3 == 0 ? 8 : 5);
    qir_cp_async_ca<4>(s1 + 16 * t + 8, in0 + 2048 + 4 * t, t % 4);
    qir_cp_async_commit();
    qir_cp_async_wait<1>();
    __syncthreads();
    for (int i = t; i < 64 * 16; i += 64) out0[i] = s0[i];
    qir_cp_async_wait<0>();
    __syncthreads();
    for (int i = t; i < 64 * 16; i += 64) out1[i] = s1[i];
  } else if (which == 4) {
    // Reads before the wait (out0[0..16)), then after it (out0[16..32)).
    __shared__ __align__(16) uint8_t s[16];
    if (t >= 16) return;
    s[t] = 0xEE;
    __syncwarp();
    if (t == 0) qir_cp_async_cg16(s, in0, 16);
    qir_cp_async_commit();
    __syncwarp();
    out0[t] = s[t];
    __syncwarp();
    qir_cp_async_wait<0>();
    __syncwarp();
    out0[16 + t] = s[t];
  } else if (which == 6) {
    // Block-scaled FP4 (sm_120a's instruction, the emulation elsewhere): per tile and lane,
    // in0: 4 registers of A codes, in1: 2 of B codes, in2: sfa and sfb, in3: 4 floats of C.
    const int at = (blockIdx.x * 2 + t / 32) * 32 + lane;
    const uint32_t* a = reinterpret_cast<const uint32_t*>(in0) + at * 4;
    const uint32_t* b = reinterpret_cast<const uint32_t*>(in1) + at * 2;
    const uint32_t* sf = reinterpret_cast<const uint32_t*>(in2) + at * 2;
    const float* c = reinterpret_cast<const float*>(in3) + at * 4;
    const uint32_t av[4] = {a[0], a[1], a[2], a[3]}, bv[2] = {b[0], b[1]};
    const float cv[4] = {c[0], c[1], c[2], c[3]};
    float d[4];
    qir_mma_m16n8k64_nvf4(d, av, bv, cv, sf[0], sf[1]);
    for (int i = 0; i < 4; ++i) reinterpret_cast<float*>(out0)[at * 4 + i] = d[i];
  } else {
    // ldmatrix rows 2 bytes past a 16-byte boundary.
    __shared__ __align__(16) uint16_t s[8][16];
    if (t >= 32) return;
    s[lane % 8][lane / 8] = 0;
    __syncwarp();
    uint32_t r[1];
    qir_ldmatrix<1, false>(r, &s[lane % 8][1]);
    out0[lane] = (uint8_t)r[0];
  }
""",
    threads=64,
)


def launch(
    be: Backend, case: str, ins: list[np.ndarray], outs: list[np.ndarray], blocks: int = 1
) -> list[np.ndarray]:
    """Runs one case; returns its outputs (fresh arrays of the given shapes and dtypes)."""
    dummy = np.zeros(16, np.uint8)
    dev_ins = [be.to_device(np.ascontiguousarray(a)) for a in ins]
    dev_ins += [be.to_device(dummy) for _ in range(5 - len(ins))]
    dev_outs = [be.to_device(o.copy()) for o in outs]
    spare = [be.to_device(dummy.copy()) for _ in range(2 - len(outs))]
    be.launch(be.load(HELPERS), (blocks, 1, 1), [CASES[case], *dev_ins, *dev_outs, *spare])
    be.synchronize()
    return [
        be.from_device(d).view(o.dtype).reshape(o.shape)
        for d, o in zip(dev_outs, outs, strict=True)
    ]


def pack_pairs(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return lo.astype(np.uint32) | (hi.astype(np.uint32) << 16)


OPERANDS = {"16": np.float16, "bf": ml_dtypes.bfloat16}


def mma_case(
    seed: int, tiles: int, integer: bool
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Fragments of `tiles` random A (16x16), B (16x8) and C (16x8), B and A in f16 and in bf16
    (small integers: every partial sum exact), and the D each operand type should give: the
    exact sum of products plus C, rounded once to fp32."""
    rng = np.random.default_rng(seed)
    if integer:
        a = rng.integers(-8, 9, (tiles, 16, 16)).astype(np.float32)
        b = rng.integers(-8, 9, (tiles, 16, 8)).astype(np.float32)
        c = rng.integers(-64, 65, (tiles, 16, 8)).astype(np.float32)
    else:
        a = rng.standard_normal((tiles, 16, 16), dtype=np.float32)
        b = rng.standard_normal((tiles, 16, 8), dtype=np.float32)
        c = rng.standard_normal((tiles, 16, 8), dtype=np.float32)
    frags = {"c": np.zeros((tiles, 32, 4), np.float32)}
    want = {}
    for lane in range(32):
        for i, (r, col) in enumerate(c_fragment(lane)):
            frags["c"][:, lane, i] = c[:, r, col]
    for suffix, dt in OPERANDS.items():
        bits_a, bits_b = a.astype(dt).view(np.uint16), b.astype(dt).view(np.uint16)
        fa = frags[f"a{suffix}"] = np.zeros((tiles, 32, 4), np.uint32)
        fb = frags[f"b{suffix}"] = np.zeros((tiles, 32, 2), np.uint32)
        for lane in range(32):
            ra, ca = np.array(a_fragment(lane)).T
            kb, nb = np.array(b_fragment(lane)).T
            fa[:, lane] = pack_pairs(bits_a[:, ra[0::2], ca[0::2]], bits_a[:, ra[1::2], ca[1::2]])
            fb[:, lane] = pack_pairs(bits_b[:, kb[0::2], nb[0::2]], bits_b[:, kb[1::2], nb[1::2]])
        exact = np.einsum(
            "tmk,tkn->tmn", a.astype(dt).astype(np.float64), b.astype(dt).astype(np.float64)
        )
        d = (exact + c).astype(np.float32)
        want[f"d{suffix}"] = np.stack(
            [np.stack([d[:, r, col] for r, col in c_fragment(lane)], -1) for lane in range(32)], 1
        )
    return frags, want


def run_mma(be: Backend, frags: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    tiles = frags["c"].shape[0]
    out = np.full((tiles, 32, 4), np.nan, np.float32)
    ins = [frags[k] for k in ("a16", "b16", "abf", "bbf", "c")]
    d16, dbf = launch(be, "mma", ins, [out, out], blocks=tiles // 2)
    return {"d16": d16, "dbf": dbf}


def ldmatrix_reference(src: np.ndarray) -> np.ndarray:
    """What each form puts in each lane's registers, by the ISA: register i of lane l holds
    matrix i's row l/4, cols 2(l%4), +1 (trans: col l/4, rows 2(l%4), +1), low half first."""
    m = src.reshape(4, 8, 8).astype(np.uint32)
    out = []
    for n in (1, 2, 4):
        for trans in (False, True):
            regs = np.zeros((32, n), np.uint32)
            for lane in range(32):
                q, e = divmod(lane, 4)
                for i in range(n):
                    lo, hi = (
                        (m[i, 2 * e, q], m[i, 2 * e + 1, q])
                        if trans
                        else (m[i, q, 2 * e], m[i, q, 2 * e + 1])
                    )
                    regs[lane, i] = lo | hi << 16
            out.append(regs.ravel())
    return np.concatenate(out)


def run_ldmatrix(be: Backend, src: np.ndarray) -> np.ndarray:
    return launch(be, "ldmatrix", [src], [np.zeros(32 * (1 + 1 + 2 + 2 + 4 + 4), np.uint32)])[0]


def run_ldmatrix_mma(be: Backend, a: np.ndarray, w: np.ndarray) -> np.ndarray:
    return launch(be, "ldmatrix_mma", [a, w], [np.full(256, np.nan, np.float32)])[0]


def cp_async_reference(src: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    out0 = np.zeros((64, 16), np.uint8)
    out1 = np.zeros((64, 16), np.uint8)
    out1[:, 12:] = 0xEE
    for t in range(64):
        n = min(t % 17, 16)
        out0[t, :n] = src[16 * t : 16 * t + n]
        n8, n4 = (8 if t % 3 == 0 else 5), t % 4
        out1[t, :n8] = src[1024 + 8 * t : 1024 + 8 * t + n8]
        out1[t, 8 : 8 + n4] = src[2048 + 4 * t : 2048 + 4 * t + n4]
    return out0.ravel(), out1.ravel()


def run_cp_async(be: Backend, src: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    out0, out1 = launch(be, "cp_async", [src], [np.zeros(64 * 16, np.uint8)] * 2)
    return out0, out1


def every_helper(be: Backend) -> dict[str, np.ndarray]:
    """Each helper's outputs on fixed inputs (the same on every backend)."""
    rng = np.random.default_rng(7)
    results: dict[str, np.ndarray] = {}
    for integer in (True, False):
        frags, _ = mma_case(3, 4, integer)
        for k, v in run_mma(be, frags).items():
            results[f"{k}_{'int' if integer else 'rand'}"] = v
    results["ldmatrix"] = run_ldmatrix(be, rng.integers(0, 2**16, 256).astype(np.uint16))
    a = rng.standard_normal(256).astype(np.float16)
    w = rng.standard_normal(128).astype(np.float16)
    results["ldmatrix_mma"] = run_ldmatrix_mma(be, a, w)
    src = rng.integers(0, 256, 4096).astype(np.uint8)
    results["cp_async0"], results["cp_async1"] = run_cp_async(be, src)
    return results


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> HostBackend:
    return HostBackend(cache_dir=tmp_path_factory.mktemp("mma-cache"))


@pytest.mark.parametrize("integer", [True, False], ids=["integers", "random"])
def test_mma_matches_numpy_through_the_isa_layouts(host: HostBackend, integer: bool) -> None:
    frags, want = mma_case(1, 6, integer)
    got = run_mma(host, frags)
    for k in ("d16", "dbf"):
        if integer:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)
        else:  # the sum of exact products, rounded once
            np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-6, err_msg=k)


def test_ldmatrix_forms_match_the_isa(host: HostBackend) -> None:
    src = np.random.default_rng(2).integers(0, 2**16, 256).astype(np.uint16)
    np.testing.assert_array_equal(run_ldmatrix(host, src), ldmatrix_reference(src))


def test_ldmatrix_feeds_mma_as_the_gemm_does(host: HostBackend) -> None:
    rng = np.random.default_rng(4)
    a = rng.standard_normal((16, 16)).astype(np.float16)
    w = rng.standard_normal((8, 16)).astype(np.float16)
    want = (a.astype(np.float64) @ w.astype(np.float64).T).astype(np.float32).ravel()
    got = run_ldmatrix_mma(host, a.ravel(), w.ravel())
    np.testing.assert_allclose(got[:128], want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[128:], got[:128])  # the .trans path gives the same B


def test_cp_async_zero_fills_and_completes_by_group(host: HostBackend) -> None:
    src = np.random.default_rng(5).integers(0, 256, 4096).astype(np.uint8)
    got0, got1 = run_cp_async(host, src)
    want0, want1 = cp_async_reference(src)
    np.testing.assert_array_equal(got0, want0)
    np.testing.assert_array_equal(got1, want1)


def test_reading_before_the_wait_sees_stale_bytes(host: HostBackend) -> None:
    """The emulation performs a copy at its wait, so a kernel missing one reads what was there
    before (on a GPU that is a race: the bytes may or may not have landed)."""
    src = np.arange(16, dtype=np.uint8)
    (out,) = launch(host, "no_wait", [src], [np.zeros(32, np.uint8)])
    np.testing.assert_array_equal(out[:16], np.full(16, 0xEE, np.uint8))
    np.testing.assert_array_equal(out[16:], src)


def test_misaligned_ldmatrix_row_fails_the_launch(host: HostBackend) -> None:
    with pytest.raises(RuntimeError, match="ldmatrix: a row address is not 16-byte aligned"):
        launch(host, "misaligned", [], [np.zeros(32, np.uint8)])


E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def ue4m3(b: np.ndarray) -> np.ndarray:
    e, m = (b >> 3) & 15, b & 7
    return np.where(e > 0, (1 + m / 8) * 2.0 ** (e.astype(np.int64) - 7), m / 512.0)


def nvf4_case(seed: int, tiles: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Random E2M1 codes of A (16x64) and B (64x8), UE4M3 scales per 16 along K, C; the
    registers each lane passes (ISA layouts for the codes; sfa/sfb as qir_mma.cuh places
    them) and the D each lane should get: the exact scaled sum plus C, rounded once."""
    rng = np.random.default_rng(seed)
    ca = rng.integers(0, 16, (tiles, 16, 64))
    cb = rng.integers(0, 16, (tiles, 64, 8))
    sa = rng.integers(0x20, 0x48, (tiles, 16, 4))  # 2^-3 .. 2^2: the sum stays exact
    sb = rng.integers(0x20, 0x48, (tiles, 8, 4))
    c = rng.integers(-64, 65, (tiles, 16, 8)).astype(np.float32)
    fa, fb = np.zeros((tiles, 32, 4), np.uint32), np.zeros((tiles, 32, 2), np.uint32)
    sf, fc = np.zeros((tiles, 32, 2), np.uint32), np.zeros((tiles, 32, 4), np.float32)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for i in range(4):
            row, k0 = g + 8 * (i & 1), 8 * t + 32 * (i >> 1)
            fa[:, lane, i] = sum(ca[:, row, k0 + j].astype(np.uint32) << (4 * j) for j in range(8))
        for i in range(2):
            k0 = 8 * t + 32 * i
            fb[:, lane, i] = sum(cb[:, k0 + j, g].astype(np.uint32) << (4 * j) for j in range(8))
        arow = g + 8 * (t & 1)
        sf[:, lane, 0] = sum(sa[:, arow, b].astype(np.uint32) << (8 * b) for b in range(4))
        sf[:, lane, 1] = sum(sb[:, g, b].astype(np.uint32) << (8 * b) for b in range(4))
        for i, (r, col) in enumerate(c_fragment(lane)):
            fc[:, lane, i] = c[:, r, col]
    a = E2M1[ca] * np.repeat(ue4m3(sa), 16, axis=2)
    b = E2M1[cb] * np.repeat(ue4m3(sb), 16, axis=2).transpose(0, 2, 1)
    d = (np.einsum("tmk,tkn->tmn", a, b) + c).astype(np.float32)
    want = np.stack(
        [np.stack([d[:, r, col] for r, col in c_fragment(lane)], -1) for lane in range(32)], 1
    )
    return [fa, fb, sf, fc], want


def test_block_scaled_fp4_mma_emulation_matches_numpy(host: HostBackend) -> None:
    """The host body of sm_120a's block-scaled FP4 MMA (the GPU instruction itself is
    compile-checked only: test_gemm_kernels builds it for sm_120a)."""
    ins, want = nvf4_case(8, 4)
    (got,) = launch(host, "nvf4", ins, [np.full((4, 32, 4), np.nan, np.float32)], blocks=2)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("variant", ["reverse", "sanitized"])
def test_reverse_schedule_and_sanitized_build_give_the_same_bytes(
    host: HostBackend, variant: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run last to first, every helper gives the same bytes (no lane reads a slot before its
    writer's exchange); built with ASan/UBSan (out-of-bounds shared or global indexing, or
    undefined arithmetic in the emulation, would abort), the same bytes too."""
    forward = every_helper(host)
    if variant == "reverse":
        monkeypatch.setenv("QIR_HOST_SCHEDULE", "reverse")
        other = every_helper(host)
    else:
        other = every_helper(HostBackend(cache_dir=tmp_path, sanitize=True))
    for name, value in forward.items():
        assert value.tobytes() == other[name].tobytes(), name


@pytest.mark.gpu
@ON_GPU
def test_ptx_matches_the_emulation_on_the_same_inputs(host: HostBackend) -> None:
    """mma.sync, ldmatrix and cp.async on the GPU against their portable bodies: bit for bit
    wherever every partial sum is exact (integer operands, copies, loads); within fp32 rounding
    of the exact sum for random operands (the tensor core adds in its own order)."""
    gpu = every_helper(get_backend("cuda"))
    cpu = every_helper(host)
    for name, value in cpu.items():
        if name.endswith("_rand") or name == "ldmatrix_mma":
            np.testing.assert_allclose(gpu[name], value, rtol=1e-5, atol=1e-5, err_msg=name)
        else:
            assert gpu[name].tobytes() == value.tobytes(), name
