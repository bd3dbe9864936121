"""Markdown table of a pytest-benchmark JSON: python -m benchmarks.summarize_cpu IN.json > OUT.md"""

import json
import platform
import sys

data = json.load(open(sys.argv[1]))
print(f"# build_plan on the CPU ({data['machine_info'].get('cpu', {}).get('brand_raw', platform.processor())})\n")
print(f"pytest-benchmark, {data['datetime'][:10]}; medians of 300 rounds x 10 calls. Spec: 32/8 heads, d=128, page 16.\n")
print("| step | what | median µs | IQR µs |\n|---|---|---:|---:|")
for b in sorted(data["benchmarks"], key=lambda b: (b["group"], b["name"])):
    what = b["name"].split("[")[1].rstrip("]").removeprefix(b["group"] + "-") if "[" in b["name"] else b["name"].removeprefix("test_")
    print(f"| {b['group']} | {what} | {b['stats']['median'] * 1e6:.1f} | {b['stats']['iqr'] * 1e6:.1f} |")
