"""Unit builds: a block's cold kernels compiled by one g++ run (qir/runtime/host_units.py) give
the bytes each kernel gives built alone; kernels whose headers read different macros, or whose
source does not split into includes and a body, never share one; a unit g++ refuses builds its
kernels one by one, and a real error still names its own kernel."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import qir
from qir.codegen.kernel import Kernel
from qir.formats.nvfp4 import Nvfp4
from qir.runtime import host as host_module
from qir.runtime.errors import CompileError
from qir.runtime.host import HostBackend
from qir.runtime.host_units import Member, plan_units, split, unit_key, unit_source
from qir.runtime.loading import load_kernels
from tests.requires import requires
from tests.runtime.test_cache import seeded
from tests.runtime.test_every_format import block, inputs
from tests.runtime.test_host import PRELUDE, buf, i32, make

# Two kernels that each define the same file-scope names and macro with their own values: one
# unit must keep them apart (a namespace each, the macro undefined after each body).
CONSTS = """constexpr int QIR_K = {k};
#define QIR_ADD {add}
__device__ __forceinline__ int qir_step(int v) {{ return v * QIR_K + QIR_ADD; }}
"""


def affine(name: str, k: int, add: int) -> Kernel:
    src = make(
        name,
        (buf("y", "int*"), i32("n")),
        "int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) y[i] = qir_step(i);",
    ).source
    src = src.replace(PRELUDE, PRELUDE + CONSTS.format(k=k, add=add))
    return Kernel(name, src, (buf("y", "int*"), i32("n")), (128, 1, 1))


def member(k: Kernel) -> Member:
    return Member(k.name, host_module.host_source(k), k.headers)


def test_a_source_splits_after_its_last_include() -> None:
    prefix, body = split('// a\n#define QIR_X 1\n#include "a.h"\n#include <b.h>\nint x;\n')
    assert (
        prefix == '// a\n#define QIR_X 1\n#include "a.h"\n#include <b.h>\n' and body == "int x;\n"
    )
    assert split("int x;\n") == ("", "int x;\n")


def test_only_sources_whose_headers_read_the_same_macros_share_a_unit() -> None:
    a, b = affine("unit_a", 3, 1), affine("unit_b", 5, 2)
    cvt = Kernel(
        "unit_cvt", "#define QIR_FP4_CVT 1\n" + a.source.replace("unit_a", "unit_cvt"), (), a.block
    )
    code = Kernel(
        "unit_code", "int early;\n" + a.source.replace("unit_a", "unit_code"), (), a.block
    )
    assert unit_key(member(a)) == unit_key(member(b)) == ()
    assert unit_key(member(cvt)) == ("#define QIR_FP4_CVT 1",)
    assert unit_key(member(code)) is None  # code before an include: never moved
    units = plan_units([member(k) for k in (a, b, cvt, code, b)], 1)
    assert sorted(units) == [[0, 1], [2], [3], [4]]  # a name twice: two units
    text = unit_source([member(a), member(b)])
    assert text.count("#include <cuda_fp16.h>") == 1
    assert "namespace qir_unit_0 {" in text and "namespace qir_unit_1 {" in text
    assert text.count("#undef QIR_ADD") == 2
    assert f'#line {PRELUDE.count(chr(10)) + 1} "unit_a.cu"' in text


@requires("gxx")
def test_a_unit_keeps_each_kernels_names_and_macros_and_loads_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QIR_COMPILE_JOBS", "1")
    be = HostBackend(cache_dir=seeded(tmp_path))
    kernels = [affine("unit_a", 3, 1), affine("unit_b", 5, 2), affine("unit_c", 7, -4)]
    done: list[str] = []
    assert be.prepare_many(kernels, lambda k: done.append(k.name)) == 1  # QIR_COMPILE_JOBS=1
    assert sorted(done) == ["unit_a", "unit_b", "unit_c"] and be.cache.compiles == 3
    loaded = load_kernels(be, kernels)
    assert loaded[0].lib is loaded[1].lib is loaded[2].lib  # one library, loaded once
    for k, (mul, add) in zip(loaded, ((3, 1), (5, 2), (7, -4)), strict=True):
        y = np.zeros(200, np.int32)
        be.launch(k, (2, 1, 1), [y, 200])
        np.testing.assert_array_equal(y, np.arange(200) * mul + add)
    # A later process reads each kernel's own entry (each holds the unit's library).
    fresh = HostBackend(cache_dir=tmp_path)
    fresh.cache.forget()
    assert fresh.load(kernels[2]).kernel == kernels[2] and fresh.cache.compiles == 3


@requires("gxx")
def test_a_refused_unit_builds_one_by_one_and_an_error_names_its_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QIR_COMPILE_JOBS", "1")
    be = HostBackend(cache_dir=seeded(tmp_path))
    good = affine("unit_good", 2, 0)
    broken = affine("unit_broken", 2, 0)
    broken = Kernel(broken.name, broken.source.replace("y[i] =", "y[i] = ;"), (), broken.block)
    singles: list[str] = []
    compile_one = be._compile
    monkeypatch.setattr(be, "_compile", lambda k, s: singles.append(k.name) or compile_one(k, s))
    with pytest.raises(CompileError, match="unit_broken") as e:
        be.prepare_many([good, broken], lambda k: None)
    assert "y[i] = ;" in str(e.value)  # the kernel's own source line, not the unit's
    assert "unit_good" in singles  # built alone once the unit was refused
    y = np.zeros(4, np.int32)
    be.launch(be.load(good), (1, 1, 1), [y, 4])
    np.testing.assert_array_equal(y, np.arange(4) * 2)


@requires("gxx")
def test_a_block_built_in_units_gives_the_bytes_of_kernels_built_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """W4A4: the activation quantizer, the GEMVs and the GEMMs (MMA emulation), FP4 codes."""
    graph, weights = block(Nvfp4("div", 4))
    units: list[int] = []
    compile_unit = HostBackend._compile_unit

    def counted(self: HostBackend, members: list[Member]) -> bytes | None:
        payload = compile_unit(self, members)
        units.append(len(members) if payload is not None else 0)
        return payload

    monkeypatch.setattr(HostBackend, "_compile_unit", counted)
    sizes = (1, 9, 20)  # the GEMVs, then the GEMMs: each a load of its own
    outs = {}
    for jobs in ("1", "64"):  # every cold kernel of a load in one unit / each alone
        monkeypatch.setenv("QIR_COMPILE_JOBS", jobs)
        monkeypatch.setenv("QIR_CACHE_DIR", str(seeded(tmp_path / jobs)))
        compiled = qir.compile(graph, weights, backend="host")
        outs[jobs] = [compiled(inputs(m)) for m in sizes]
        if jobs == "1":
            assert len(units) >= 2 and all(n > 1 for n in units), units  # none refused
    assert len(units) == len([n for n in units if n > 1])  # no unit where each builds alone
    for m, together, alone in zip(sizes, outs["1"], outs["64"], strict=True):
        for name, value in together.items():
            assert value.tobytes() == alone[name].tobytes(), (m, name)


@requires("gxx")
def test_ranks_that_want_the_same_cold_kernels_build_them_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two backends on one cache (the ranks of a tensor-parallel model on one machine: their
    shards often have the same shapes) preparing the same cold kernels at once: one g++ run
    builds them, the other rank reads the entries. A set of which some are built compiles the
    rest only."""
    monkeypatch.setenv("QIR_COMPILE_JOBS", "1")
    root = seeded(tmp_path)
    kernels = [affine("rank_a", 3, 1), affine("rank_b", 5, 2)]
    runs: list[list[str]] = []
    gxx = HostBackend._gxx

    def counted(self: HostBackend, name: str, *rest: Any) -> bytes:
        runs.append([n for n in ("rank_a", "rank_b", "rank_c") if f" {n}(" in rest[0]])
        return gxx(self, name, *rest)

    monkeypatch.setattr(HostBackend, "_gxx", counted)
    HostBackend(cache_dir=root)._runtime_library()  # not what this test counts
    runs.clear()
    ranks = [HostBackend(cache_dir=root) for _ in range(2)]
    start = threading.Barrier(2)

    def prepare(be: HostBackend) -> list[str]:
        start.wait()
        done: list[str] = []
        be.prepare_many(kernels, lambda k: done.append(k.name))
        return done

    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(prepare, ranks))
    assert runs == [["rank_a", "rank_b"]], runs  # one unit, once
    assert all(sorted(d) == ["rank_a", "rank_b"] for d in done)
    assert ranks[0].cache.compiles == 2  # one cache object per root: both ranks' count
    for be in ranks:
        y = np.zeros(8, np.int32)
        be.launch(be.load(kernels[1]), (1, 1, 1), [y, 8])
        np.testing.assert_array_equal(y, np.arange(8) * 5 + 2)
    more = [kernels[0], affine("rank_c", 7, 0)]
    HostBackend(cache_dir=root).prepare_many(more, lambda k: None)
    assert runs[1:] == [["rank_c"]], runs
