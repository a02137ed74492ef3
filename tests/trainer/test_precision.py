import pytest
import torch

from trainer.precision import autocast_for, compute_dtype, cpu_flags, native_bf16

CPU = torch.device("cpu")


def test_cpu_flags_read_x86_and_arm_cpuinfo(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16 amx_tile\nbugs\t\t: spectre\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n")
    assert {"avx512_bf16", "amx_tile"} <= cpu_flags(x86) and "spectre" not in cpu_flags(x86)
    assert "bf16" in cpu_flags(arm)
    assert cpu_flags(tmp_path / "missing") == set()


def test_auto_picks_bf16_exactly_where_the_cpu_has_it():
    for flags, expect in ((set(), torch.float32), ({"avx2", "avx512f"}, torch.float32),
                          ({"avx512_bf16"}, torch.bfloat16), ({"amx_bf16"}, torch.bfloat16), ({"bf16"}, torch.bfloat16)):
        assert compute_dtype("auto", CPU, flags) == expect, flags
        assert compute_dtype("fp32", CPU, flags) == torch.float32  # asked for: never changed
        assert compute_dtype("bf16", CPU, flags) == torch.bfloat16


def test_this_machine_agrees_with_torchs_own_cpu_detection():
    """/proc/cpuinfo against torch's cpuinfo library (x86: avx512_bf16 or AMX)."""
    if not hasattr(torch.cpu, "_is_avx512_bf16_supported") or "avx2" not in cpu_flags():
        pytest.skip("not x86, or a torch without the probe: nothing independent to compare with")
    torch_says = torch.cpu._is_avx512_bf16_supported() or "amx_bf16" in cpu_flags() and torch.cpu._is_amx_tile_supported()
    assert native_bf16(CPU) == torch_says


def test_autocast_follows_the_choice():
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    with autocast_for("bf16", CPU):
        assert (a @ b).dtype == torch.bfloat16
    with autocast_for("fp32", CPU):
        assert (a @ b).dtype == torch.float32
    with autocast_for("auto", CPU):
        assert (a @ b).dtype == compute_dtype("auto", CPU)
