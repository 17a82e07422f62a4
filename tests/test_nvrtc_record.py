"""The record of the suite's NVRTC builds and nvdisasm listings (tests/nvrtc_record.py): a
recorded build or listing is what the tool made of that input, served without running it; a
changed text, arch, compiler or cubin misses."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from qir.cost import sass
from qir.runtime import nvrtc
from tests import nvrtc_record
from tests.requires import requires
from tests.runtime.test_nvrtc import HALF_SUM

pytestmark = requires("nvrtc", "nvdisasm")


def test_a_recorded_build_and_listing_are_served_as_the_tools_made_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shards, record = tmp_path / "shards", tmp_path / "record.zip"
    shards.mkdir()
    toolkit, tool = nvrtc._toolchain(), sass.nvdisasm()
    assert tool is not None
    # The session's NVRTC compile and nvdisasm listing are already the hooked ones
    # (tests/conftest.py): the tools themselves, counted.
    compile_real = getattr(nvrtc._compile, "compile", nvrtc._compile)
    listing_real = getattr(sass._listing, "listing", sass._listing)
    calls: list[str] = []

    def compile_(kernel: Any, arch: str, tk: Any) -> nvrtc.CubinResult:
        calls.append(f"nvrtc {kernel.name} {arch}")
        return compile_real(kernel, arch, tk)

    def listing(t: Path, cubin: bytes) -> bytes:
        calls.append(f"nvdisasm {len(cubin)}")
        return listing_real(t, cubin)

    def run() -> tuple[nvrtc.CubinResult, bytes]:
        built = nvrtc_record.hooked(compile_)(HALF_SUM, "sm_90", toolkit)
        return built, nvrtc_record.hooked_listing(listing)(tool, built.cubin)

    monkeypatch.setenv(nvrtc_record.MODE, "write")
    monkeypatch.setenv(nvrtc_record.SHARDS, str(shards))
    built, listed = run()
    assert nvrtc_record.write(shards, record) == 2 and len(calls) == 2
    assert b"half_sum8" in listed

    monkeypatch.setattr(nvrtc_record, "PATH", record)
    monkeypatch.delenv(nvrtc_record.MODE)
    assert run() == (built, listed) and len(calls) == 2  # the record's, neither tool ran
    assert nvrtc_record.lookup(HALF_SUM, "sm_90", record) == built

    changed = dataclasses.replace(HALF_SUM, source=HALF_SUM.source + "\n// changed\n")
    for kernel, arch in ((changed, "sm_90"), (HALF_SUM, "sm_80")):
        assert nvrtc_record.lookup(kernel, arch, record) is None
        nvrtc_record.hooked(compile_)(kernel, arch, toolkit)
    nvrtc_record.hooked_listing(listing)(tool, built.cubin + b"\0")  # another cubin
    assert calls[2:] == [
        "nvrtc half_sum8 sm_90",
        "nvrtc half_sum8 sm_80",
        f"nvdisasm {len(built.cubin) + 1}",
    ]
    monkeypatch.setattr(nvrtc, "nvrtc_version", lambda: (99, 0))
    assert nvrtc_record.lookup(HALF_SUM, "sm_90", record) is None  # another NVRTC
