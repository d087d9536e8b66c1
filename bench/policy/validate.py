"""How long a large routing policy takes to load: read, YAML, validation, and the checks that
span rules (`Policy.problems`), at 1,000 to 20,000 rules (issue 22: the old pairwise check
took 2.8 s at 1,000 rules, 49 s at 6,000 and 256 s at 15,000, so a valid 6,000-rule policy
was refused by the proxy's 10 s loading bound).

    .venv/bin/python bench/policy/validate.py          (writes bench/results/policy-validate.*)

One rule in 20 is a glob with its own literal prefix, one in 20 one with its own literal
suffix, the rest exact topics; the policy is valid. No stack is needed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from crossdc.topology import load_topology  # noqa: E402
from proxy.policy import load_policy  # noqa: E402

SIZES = (1_000, 6_000, 15_000, 20_000)
BEFORE_S = {1_000: 2.8, 6_000: 49.0, 15_000: 256.0}  # measured in issue 22, before


def policy_text(n: int) -> str:
    lines = ["rules:"]
    for i in range(n):
        if i % 20 == 0:
            lines.append(f"  - topic: 'g{i}.*'")
        elif i % 20 == 1:
            lines.append(f"  - topic: '*.dlq{i}'")
        else:
            lines.append(f"  - topic: t.{i}")
    return "\n".join(lines) + "\n"


def main() -> None:
    topo = load_topology(ROOT / "policies" / "topology.local.yaml")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in SIZES:
            path = Path(tmp) / f"p{n}.yaml"
            path.write_text(policy_text(n))
            started = time.perf_counter()
            policy = load_policy(path, topo)
            load_s = time.perf_counter() - started
            index = policy._index
            assert index is not None
            index.tests = index.probes = 0
            started = time.perf_counter()
            assert list(policy.problems(topo)) == []
            problems_s = time.perf_counter() - started
            rows.append({"rules": n, "bytes": path.stat().st_size, "load_s": round(load_s, 3),
                         "problems_s": round(problems_s, 4), "glob_tests": index.tests,
                         "dict_probes": index.probes, "before_s": BEFORE_S.get(n)})
            print(rows[-1], flush=True)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True, check=False).stdout.strip()
    doc = {"git_commit": commit, "load_avg": os.getloadavg(), "rows": rows}
    out = ROOT / "bench" / "results"
    (out / "policy-validate.json").write_text(json.dumps(doc, indent=2) + "\n")
    md = ["# Policy loading: read, YAML, validation, cross-rule checks",
          "",
          f"`bench/policy/validate.py`, commit `{commit}`, load average "
          f"{doc['load_avg'][0]:.2f} (2 shared cores). `load` is all of `load_policy` (the "
          "proxy's start and every reload do the same); `problems` is the cross-rule check "
          "alone, which used to compare every rule with every earlier one.",
          "",
          "| rules | bytes | load (s) | problems (s) | glob tests | dict probes | before (s) |",
          "|---:|---:|---:|---:|---:|---:|---:|"]
    md += [f"| {r['rules']:,} | {r['bytes']:,} | {r['load_s']} | {r['problems_s']} | "
           f"{r['glob_tests']} | {r['dict_probes']:,} | {r['before_s'] or '-'} |" for r in rows]
    (out / "policy-validate.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
