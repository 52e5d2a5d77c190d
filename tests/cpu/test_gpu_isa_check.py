"""The CI's ISA check (.ci/gpu_isa_check.py) on small disassemblies in both dialects: it passes
16-byte GEMV loads and fails narrow ones, a missing kernel, and a kernel of too few wide loads."""

import importlib.util
import sys
from pathlib import Path

import pytest

_path = Path(__file__).resolve().parents[2] / ".ci" / "gpu_isa_check.py"
_spec = importlib.util.spec_from_file_location("gpu_isa_check", _path)
isa = importlib.util.module_from_spec(_spec)
sys.modules["gpu_isa_check"] = isa  # dataclasses look their module up
_spec.loader.exec_module(isa)


def sass(name, loads):
    lines = [f"\t\tFunction : {name}"]
    for i, ld in enumerate(loads):
        lines.append(f"        /*{i * 16:04x}*/                   {ld} R4, desc[UR4][R2.64] ;   /* 0x0000000402047981 */")
        lines.append(f"        /*{i * 16 + 8:04x}*/              @P0 FFMA R1, R2, R3, R1 ;   /* 0x0000000302017223 */")
    return "\n".join(lines)


def amd(name, loads):
    lines = [f"0000000000001000 <{name}>:"]
    lines += [f"\t{ld} v[0:3], v[4:5], off                       // 000000001000: DC5C8000 007F0004" for ld in loads]
    return "\n".join(lines)


GEMV = "_ZN3kog3gpu13linear_kernelI13__nv_bfloat16EEvNS_12LinearParamsEl"
GEMV_FP8 = "_ZN3kog3gpu19linear_quant_kernelI13__nv_bfloat16NS0_6decode7Fp8E4M3EEEvNS_12LinearParamsEPKvl"
GEMV_Q4 = "_ZN3kog3gpu19linear_quant_kernelI13__nv_bfloat16NS0_6decode10Int4GroupsEEEvNS_12LinearParamsEPKvl"
ATTN = "_ZN3kog3gpu24attention_partial_kernelI13__nv_bfloat16EEvNS_20PagedAttentionParamsEPfi"
ATTN_F32 = "_ZN3kog3gpu24attention_partial_kernelIfEEvNS_20PagedAttentionParamsEPfi"
PERSISTENT = "_ZN3kog3gpu6decode24persistent_decode_kernelI13__nv_bfloat16EEvNS1_22PersistentDecodeParamsE"
STAGE_COPY = "LDGSTS.E.BYPASS.128"
WORD = {"sass": "LDG.E", "amdgcn": "global_load_dword"}  # a 4-byte load: block table, lengths


def module(make, dialect, wide, narrow, gemv=None, attn=None, persistent=None, fp8=None, q4=None):
    """A module as the CI sees it: the GEMV, its FP8 and 4-bit twins, the bf16 attention, the fp32 attention
    (whose 4-byte K/V loads are not told apart from its table loads) and the persistent kernel
    (its weight staging copies on NVIDIA)."""
    gemv = [wide] * 4 + [narrow] * 3 if gemv is None else gemv
    fp8 = [wide] * 4 + [narrow] * 2 + [WORD[dialect]] * 2 if fp8 is None else fp8  # bias and scale per path
    q4 = [wide] * 4 + [narrow] * 2 + [WORD[dialect]] * 7 if q4 is None else q4  # bias, a group pair per vector
    attn = [wide] * 3 + [WORD[dialect]] * 2 if attn is None else attn
    if persistent is None:
        persistent = [STAGE_COPY] * 16 + [narrow] if dialect == "sass" else [narrow]
    return "\n".join([make(GEMV, gemv), make(GEMV_FP8, fp8), make(GEMV_Q4, q4), make(ATTN, attn), make(ATTN_F32, [WORD[dialect]] * 9),
                      make(PERSISTENT, persistent)])


CASES = [("sass", sass, "LDG.E.128.CONSTANT", "LDG.E.U16.CONSTANT", "STL"),
         ("amdgcn", amd, "global_load_dwordx4", "global_load_ushort", "scratch_store_dword")]


@pytest.mark.parametrize("dialect,make,wide,narrow,spill", CASES)
def test_wide_loads_pass_and_narrow_ones_fail(dialect, make, wide, narrow, spill):
    assert isa.check(module(make, dialect, wide, narrow), dialect) == []  # a bias load per batch class
    assert isa.check(module(make, dialect, wide, narrow, gemv=[wide] * 4 + [narrow] * 4), dialect)  # one more
    assert isa.check(module(make, dialect, wide, narrow, gemv=[wide] * 4 + [narrow] * 8), dialect)  # 2-byte weights
    assert isa.check(module(make, dialect, wide, narrow, gemv=[wide] * 3), dialect)  # too few in flight
    assert isa.check(module(make, dialect, wide, narrow, gemv=[wide] * 4 + [spill]), dialect)  # a spill
    assert isa.check(module(make, dialect, wide, narrow, attn=[wide] * 3 + [narrow]), dialect)  # a 2-byte K load
    assert isa.check(module(make, dialect, wide, narrow, attn=[WORD[dialect]] * 6), dialect)  # scalar K/V
    assert isa.check(make(GEMV, [wide] * 4), dialect)  # the attention kernels are missing


@pytest.mark.parametrize("dialect,make,wide,narrow,spill", CASES)
def test_the_fp8_gemv_streams_16_byte_weight_vectors(dialect, make, wide, narrow, spill):
    byte = {"sass": "LDG.E.U8.CONSTANT", "amdgcn": "global_load_ubyte"}[dialect]
    assert isa.check(module(make, dialect, wide, narrow, fp8=[wide] * 4 + [WORD[dialect]] * 6), dialect) == []
    assert isa.check(module(make, dialect, wide, narrow, fp8=[wide] * 4 + [byte] * 16), dialect)  # byte-wise weights
    assert isa.check(module(make, dialect, wide, narrow, fp8=[wide] * 3), dialect)  # too few in flight
    assert isa.check(module(make, dialect, wide, narrow, fp8=[wide] * 4 + [spill]), dialect)  # a spill
    assert isa.check(module(make, dialect, wide, narrow, gemv=[wide] * 4).replace(GEMV_FP8, "other"), dialect)  # missing


@pytest.mark.parametrize("dialect,make,wide,narrow,spill", CASES)
def test_the_q4_gemv_streams_16_byte_code_vectors(dialect, make, wide, narrow, spill):
    byte = {"sass": "LDG.E.U8.CONSTANT", "amdgcn": "global_load_ubyte"}[dialect]
    assert isa.check(module(make, dialect, wide, narrow, q4=[wide] * 4 + [WORD[dialect]] * 12), dialect) == []
    assert isa.check(module(make, dialect, wide, narrow, q4=[wide] * 4 + [WORD[dialect]] * 13), dialect)  # one more
    assert isa.check(module(make, dialect, wide, narrow, q4=[wide] * 4 + [byte] * 16), dialect)  # byte-wise codes
    assert isa.check(module(make, dialect, wide, narrow, q4=[wide] * 3), dialect)  # too few in flight
    assert isa.check(module(make, dialect, wide, narrow, q4=[wide] * 4 + [spill]), dialect)  # a spill
    assert isa.check(module(make, dialect, wide, narrow).replace(GEMV_Q4, "other"), dialect)  # missing


def test_the_persistent_kernel_must_stage_weights_asynchronously_on_nvidia():
    ok = module(sass, "sass", "LDG.E.128", "LDG.E.U16")
    assert isa.check(ok, "sass") == []
    assert isa.check(module(sass, "sass", "LDG.E.128", "LDG.E.U16", persistent=[STAGE_COPY] * 15), "sass")
    assert isa.check(module(sass, "sass", "LDG.E.128", "LDG.E.U16", persistent=["LDG.E.128"] * 32), "sass")
    # AMD stages in registers: the rule does not apply, and a module without its kernel passes
    assert isa.check(module(amd, "amdgcn", "global_load_dwordx4", "global_load_ushort", persistent=[]), "amdgcn") == []


def test_sass_predicates_and_other_functions_are_parsed():
    text = sass("foo", ["LDG.E.U16"]) + "\n" + module(sass, "sass", "LDG.E.128", "LDG.E.U16")
    fns = isa.functions(text, "sass")
    assert fns["foo"] == ["LDG.E.U16", "FFMA"] and fns[GEMV].count("LDG.E.128") == 4
    assert isa.check(text, "sass") == []  # narrow loads elsewhere are not the GEMV's
