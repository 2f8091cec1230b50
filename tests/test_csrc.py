"""csrc/: every C++ source compiles without a warning (-Wall -Wextra -Werror, syntax only: seconds, no build) for
every instruction set's flags, whatever this CPU runs, and the torch ops against this torch's headers; a warning
fails the check."""
import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

import cpu_gemv

CXX = os.environ.get("CXX", "g++")
pytestmark = [pytest.mark.skipif(shutil.which(CXX) is None, reason="no C++ compiler"),
              pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 kernel sets")]
EVERY = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}
WARNINGS = ["-fsyntax-only", "-Wall", "-Wextra", "-Werror"]


def warnings(sources: list[Path], flags: list[str]) -> str:
    """What the compiler says about the sources with flags (nothing: they are clean)."""
    run = subprocess.run([CXX, *WARNINGS, *flags, *map(str, sources)], capture_output=True, text=True)
    return run.stderr if run.returncode else ""


def kernel_sets() -> list[tuple[str, list[Path], list[str]]]:
    """Every kernel set's sources and flags: AVX2, AVX-512 with and without BF16 and VNNI, either L1 size."""
    sets = {}
    for l1 in (32, 48):
        with pytest.MonkeyPatch.context() as m:
            m.setattr(cpu_gemv, "l1_data_kb", lambda: l1)
            for flags in (EVERY, EVERY - {"avx512_bf16"}):
                for name, sources, f in cpu_gemv.targets(flags):
                    sets[" ".join(f)] = (name, sources, f)
    return list(sets.values())


@pytest.mark.parametrize("name,sources,flags", kernel_sets(), ids=lambda v: v if isinstance(v, str) else None)
def test_every_kernel_set_compiles_without_a_warning(name, sources, flags):
    assert warnings(sources, ["-O3", *flags, "-fopenmp"]) == ""


def test_the_torch_ops_compile_without_a_warning_against_this_torchs_headers():
    sources, flags = cpu_gemv.ops_build()
    assert warnings(sources, [f for f in flags if not f.startswith(("-L", "-l", "-Wl", "-shared"))]) == ""


def test_every_source_is_checked():
    checked = {p.name for _, sources, _ in kernel_sets() for p in sources} | {"ops.cpp"}
    assert checked == {p.name for p in cpu_gemv.CSRC.glob("*.cpp")}


def test_a_warning_fails_the_check(tmp_path):
    (tmp_path / "unused.cpp").write_text("int f() {\n    int unused;\n    return 0;\n}\n")
    assert "unused.cpp:2:" in warnings([tmp_path / "unused.cpp"], [])
