"""summary.md and results.json of a bench/device_check.sh run, from its logs folder (rewritten
after every step, so a run cut short still reports what it did). Standard library only.

    python bench/device_report.py --logs build/device/logs --out OUT --budget 330 --elapsed 120 \
        --backend cuda --archs 90a --dry-run 0
"""

from __future__ import annotations

import argparse
import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

FAIL_LINE = re.compile(r"^(FAILED|ERROR) |^E  +|error[: ]|Error:|Traceback|Timeout|CUDA error|Invalid __global__|"
                       r"ERROR SUMMARY: [1-9]|Program hit|=========  ")

RESULT = re.compile(r" (PASSED|SKIPPED|XFAIL|XPASS)\b")  # a -v line of a test that did not fail


def read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def read_steps(logs: Path) -> list[dict]:
    """steps.tsv rows: name, status, seconds, exit code ('-' when it did not run), limit."""
    steps = []
    for line in (logs / "steps.tsv").read_text().splitlines():
        name, status, secs, rc, limit = (line.split("\t") + ["-", "0"])[:5]
        steps.append(dict(name=name, status=status, seconds=int(secs), rc=rc, limit_s=int(limit)))
    return steps


def test_counts(logs: Path, name: str) -> dict | None:
    """Counts from the step's junit xml, or from its -v log where the xml was never written."""
    xml = logs / f"{name}.xml"
    if xml.exists():
        try:
            root = ET.parse(xml).getroot()
            suite = root if root.tag == "testsuite" else root.find("testsuite")
            n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
            n["passed"] = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
            return n
        except (ET.ParseError, AttributeError, ValueError):
            pass
    log = logs / f"{name}.log"
    if not log.exists():
        return None
    text = log.read_text(errors="replace")
    n = {k: len(re.findall(rf"::\S+ {k.upper()}", text)) for k in ("passed", "failed", "error", "skipped")}
    if not any(n.values()):
        m = re.findall(r"^=*\s*(\d+ (?:passed|failed|errors?|skipped|deselected)\b.*?) in [\d.]+s", text, re.M)
        return {"summary": m[-1]} if m else None  # pytest -q's last line
    return n


def first_failure(logs: Path, name: str, keep: int = 12) -> list[str]:
    """The lines that say what went wrong: pytest's FAILED/ERROR lines, compiler or Python errors,
    sanitizer reports; for a step cut off, the last test it started; then the log's last lines."""
    log = logs / f"{name}.log"
    if not log.exists():
        return []
    lines = log.read_text(errors="replace").splitlines()
    hits = [ln for ln in lines if FAIL_LINE.search(ln) and not RESULT.search(ln)][:keep]
    started = [ln for ln in lines if re.match(r"^tests/\S+::\S+", ln)]
    if started and not re.search(r"(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)", started[-1]):
        hits.append(f"(last test started, no result: {started[-1].strip()})")
    return hits + ["--- last lines ---"] + lines[-8:]


def latency_table(logs: Path) -> tuple[str, dict]:
    txt, jsonl = logs / "decode_latency.txt", logs / "decode_latency.jsonl"
    data: dict = {"rows": [], "swap": []}
    if jsonl.exists():
        for line in jsonl.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "copy_gbs" in r:
                data.update(r)
            else:
                data["rows" if "engine" in r else "swap"].append(r)
    if txt.exists():
        return txt.read_text(), data
    log = logs / "decode_latency.log"  # cut short: the rows it printed
    return (log.read_text(errors="replace") if log.exists() else ""), data


def main() -> None:
    ap = argparse.ArgumentParser()
    for a in ("--logs", "--out", "--backend", "--archs"):
        ap.add_argument(a, required=True)
    ap.add_argument("--budget", type=int, required=True)
    ap.add_argument("--elapsed", type=int, required=True)
    ap.add_argument("--dry-run", type=int, default=0)
    args = ap.parse_args()
    logs, out = Path(args.logs), Path(args.out)
    steps = read_steps(logs)
    for s in steps:
        s["tests"] = test_counts(logs, s["name"])
        s["first_failure"] = first_failure(logs, s["name"]) if s["status"] != "ok" and s["rc"] != "-" else []
    latency_text, latency = latency_table(logs)
    prefill_text = read(logs / "prefill_attention.log")
    gpu_code = re.findall(r"^\s*\d+ (sm_\w+(?: \(ptx\))?)$", read(logs / "build.log"), re.M)
    torch_line = next((ln for ln in read(logs / "env.log").splitlines() if " torch " in ln), "")
    failed = [s["name"] for s in steps
              if s["rc"] not in ("0", "-") or s["status"].startswith(("failed", "skipped (budget"))]
    ok = not failed

    md = [f"# Kog device check{' (DRY RUN, no GPU)' if args.dry_run else ''}: "
          f"{'every step that ran passed' if ok else 'FAILED: ' + ', '.join(failed)}",
          f"backend {args.backend}, archs {args.archs}, {args.elapsed}s of a {args.budget}s budget; "
          f"python/torch: {torch_line.strip() or '?'}; GPU code in _C: {', '.join(gpu_code) or '?'}", "",
          "| step | status | s | limit | tests |", "|---|---|---|---|---|"]
    for s in steps:
        t = s["tests"]
        tests = "-" if not t else t.get("summary") or ", ".join(f"{v} {k}" for k, v in t.items() if v and k != "tests")
        md.append(f"| {s['name']} | {s['status']} | {s['seconds']} | {s['limit_s']} | {tests} |")
    for s in steps:
        if s["first_failure"]:
            md += ["", f"## {s['name']}: {s['status']}", "```", *s["first_failure"], "```"]
    if latency_text:
        md += ["", "## decode latency", "```", latency_text.rstrip(), "```"]
    if prefill_text:
        md += ["", "## prefill attention", "```", prefill_text.rstrip(), "```"]
    (out / "summary.md").write_text("\n".join(md) + "\n")
    result = dict(ok=ok, dry_run=bool(args.dry_run), backend=args.backend, archs=args.archs, budget_s=args.budget,
                  elapsed_s=args.elapsed, torch=torch_line.strip(), gpu_code=gpu_code, steps=steps,
                  decode_latency=latency, prefill_attention=prefill_text.splitlines())
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
