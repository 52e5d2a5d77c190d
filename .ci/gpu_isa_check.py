#!/usr/bin/env python3
"""ISA check of the GPU kernels' memory accesses, from their disassembly (no GPU needed).

    cuobjdump -sass _C.so | python3 .ci/gpu_isa_check.py sass
    llvm-objdump -d --mcpu=gfx90a CODE_OBJECT | python3 .ci/gpu_isa_check.py amdgcn

Rules (issue 16), checked on the standalone kernels that run the persistent kernel's work items
(the persistent kernel inlines every op into one function, so its loads cannot be told apart):
- the GEMV (linear_kernel, gpu/decode/linear_item.cuh) streams its weights and reads x in
  16-byte loads only; three narrower loads are allowed: the bias element of a row, which the
  compiler places once per code path (batch 1 and batch 2-8 are separate instantiations, and
  hipcc splits one of them again for fp32); a 2-byte weight stream shows 8 per vector;
- the FP8 GEMV (linear_quant_kernel<T, Fp8E4M3>, the same work item over one-byte e4m3 weights) likewise: 16
  weights per 16-byte load; its narrower loads are the bias element and the row's f32 scale,
  each once per code path (6 at most); a byte-wise weight stream would show 16 per vector;
- the 4-bit GEMV (linear_quant_kernel<T, Int4Groups | Int4Q4K>, the same item over 4-bit codes):
  32 codes per 16-byte load; its narrower loads are the bias element and, for WEIGHT_Q4_GROUPS,
  each group's 4-byte (scale, min) pair, once per vector in flight per code path (4 + 1 at
  batch 1, 1 + 1 at batches 2-8: 12 at most with the bias); Q4_K headers are 16-byte loads;
  a byte-wise code stream would show 16 per vector;
- none spills to local memory (STL/LDL; scratch on CDNA): the hot loops stay in registers
  (the persistent kernel spills a few outer-loop values, counted by the resource report);
- attention (attention_partial_kernel, gpu/decode/attention_item.cuh) reads q, K and V in
  16-byte loads: its 16-bit instantiations issue no 2-byte load at all (its 4-byte loads are
  the block table and lengths, so the fp32 instantiation cannot be told apart and is not
  checked for narrow loads);
- NVIDIA: the persistent decode kernel stages weights with asynchronous 16-byte copies into
  shared memory (cp.async: LDGSTS.E.BYPASS.128, gpu/decode/weight_stage.cuh), at least one
  stage's worth (2 rows x 8 vectors) of them (AMD stages in registers: nothing to check).
Exits 1, naming the kernel and the counts, when a rule fails or no checked kernel is found.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

# Global loads by width, per dialect, matched on mnemonics: "wide" is 16 bytes, "narrow" any
# narrower width, "16bit" the 2-byte ones.
LOADS = {
    "sass": {"wide": re.compile(r"^LDG\.E\.128\b"),
             "narrow": re.compile(r"^LDG\.E(\.(U8|S8|U16|S16|64))?(\.[A-Z]+)*$"),
             "16bit": re.compile(r"^LDG\.E\.(U16|S16)(\.[A-Z]+)*$"),
             "local": re.compile(r"^(STL|LDL)\b"),
             "async": re.compile(r"^LDGSTS\.E(\.[A-Z]+)*\.128$")},
    "amdgcn": {"wide": re.compile(r"^global_load_dwordx4$"),
               "narrow": re.compile(r"^global_load_(ubyte|sbyte|ushort|sshort|short_d16\w*|ubyte_d16\w*|dword|dwordx2|dwordx3)$"),
               "16bit": re.compile(r"^global_load_(ushort|sshort|short_d16\w*)$"),
               "local": re.compile(r"^(scratch|buffer)_(load|store)_")},
}


@dataclass(frozen=True)
class Rule:
    kernel: re.Pattern[str]  # mangled-name pattern of the kernels it applies to
    min_wide: int            # at least this many 16-byte loads
    max_narrow: int          # at most this many loads of the `narrow` class
    narrow: str = "narrow"   # which loads count as narrow: "narrow" (any < 16 B) or "16bit"
    max_local: int = 0       # local-memory (spill) loads and stores allowed
    min_async: int = 0       # at least this many asynchronous 16-byte copies to shared memory
    dialects: tuple[str, ...] = ("sass", "amdgcn")


RULES = (Rule(re.compile(r"linear_kernel"), min_wide=4, max_narrow=3),
         Rule(re.compile(r"linear_quant_kernel\w*Fp8E4M3"), min_wide=4, max_narrow=6),
         Rule(re.compile(r"linear_quant_kernel\w*Int4"), min_wide=4, max_narrow=12),
         Rule(re.compile(r"attention_partial_kernelI\w*(bfloat16|half)E"), min_wide=3, max_narrow=0, narrow="16bit"),
         Rule(re.compile(r"persistent_decode_kernel"), min_wide=0, max_narrow=1 << 30, max_local=1 << 30, min_async=16,
              dialects=("sass",)))


def functions(text: str, dialect: str) -> dict[str, list[str]]:
    """{function name: its instruction mnemonics (predicates stripped)} of a disassembly."""
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if dialect == "sass":
            m = re.search(r"Function : (\S+)", line)
            if m:
                current = out.setdefault(m.group(1), [])
                continue
            m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
            if m and current is not None:
                words = m.group(1).split()
                if words and words[0].startswith("@"):
                    words = words[1:]
                if words:
                    current.append(words[0])
        else:
            m = re.match(r"^[0-9a-f]+ <(\S+)>:$", line)
            if m:
                current = out.setdefault(m.group(1), [])
                continue
            words = line.split()
            if current is not None and words and re.match(r"^[a-z_][a-z0-9_]*$", words[0]):
                current.append(words[0])
    return out


def check(text: str, dialect: str) -> list[str]:
    """The failures (empty: every rule holds); prints one line per checked kernel."""
    fns = functions(text, dialect)
    failures = []
    for rule in RULES:
        if dialect not in rule.dialects:
            continue
        matched = {name: ins for name, ins in fns.items() if rule.kernel.search(name)}
        if not matched:
            failures.append(f"no kernel matches {rule.kernel.pattern!r}")
        for name, ins in sorted(matched.items()):
            wide = sum(bool(LOADS[dialect]["wide"].match(i)) for i in ins)
            narrow = sum(bool(LOADS[dialect][rule.narrow].match(i)) for i in ins)
            local = sum(bool(LOADS[dialect]["local"].match(i)) for i in ins)
            copies = sum(bool(LOADS[dialect]["async"].match(i)) for i in ins) if rule.min_async else 0
            ok = (wide >= rule.min_wide and narrow <= rule.max_narrow and local <= rule.max_local
                  and copies >= rule.min_async)
            what = "narrower" if rule.narrow == "narrow" else "2-byte"
            if rule.min_async:
                print(f"isa {dialect}: {'ok  ' if ok else 'FAIL'} {name}: {copies} async 16-byte copies to shared "
                      f"memory (>= {rule.min_async})")
            else:
                print(f"isa {dialect}: {'ok  ' if ok else 'FAIL'} {name}: {wide} 16-byte loads (>= {rule.min_wide}), "
                      f"{narrow} {what} (<= {rule.max_narrow}), {local} local-memory accesses (<= {rule.max_local})")
            if not ok:
                failures.append(f"{name}: {wide} 16-byte and {narrow} {what} global loads, {local} local accesses, "
                                f"{copies} async copies")
    return failures


def main() -> int:
    if len(sys.argv) != 2 or sys.argv[1] not in LOADS:
        print(__doc__, file=sys.stderr)
        return 2
    failures = check(sys.stdin.read(), sys.argv[1])
    for f in failures:
        print(f"gpu_isa_check: FAIL: {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
