"""What installing trackio would add to the notebook kernel's environment.

hvdnb writes trackio's project format with the standard library's ``sqlite3``
(``hvdnb/notebook/metrics/trackio_export.py``) instead of depending on trackio. This bench
asks pip, without installing anything (``pip install --dry-run --report``), which
distributions ``trackio==VERSION`` would install into this Python's environment (those not
already there), and lists them. It reads the package index pip is configured with.

Usage: ``python bench/bench_trackio_deps.py [--version 0.43.0]``; prints the list and writes
``bench/results/trackio_deps.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", default="0.43.0")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "trackio_deps.json"))
    args = ap.parse_args(argv)
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", "-"]
    cmd.append(f"trackio=={args.version}")
    res = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600)
    report = json.loads(res.stdout)
    names = sorted(
        f"{item['metadata']['name']}=={item['metadata']['version']}" for item in report["install"]
    )
    print(f"trackio=={args.version} would install {len(names)} distributions here:")
    for n in names:
        print(f"  {n}")
    out = {
        "requirement": f"trackio=={args.version}",
        "python": sys.version.split()[0],
        "environment": sys.prefix,
        "installs": len(names),
        "distributions": names,
        "date": time.strftime("%Y-%m-%d"),
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
