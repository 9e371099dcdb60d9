"""Plot a postprocess benchmark table (the markdown that bench_postprocess.py prints) as a PNG.

    python scripts/plot_bench.py docs/h200_postprocess.md docs/h200_postprocess.png

Needs matplotlib (not part of the test environment). Bars: time of each kernel relative to a plain
device copy of the same bytes (1.0 = copy speed), log scale.
"""

import re
import sys
import textwrap


def rows(path):
    for line in open(path):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and cells[0] not in ("case",) and not set(cells[0]) <= {"-"}:
            yield cells


def ms(cell):
    m = re.match(r"([\d.]+) ms", cell)
    return float(m.group(1)) if m else None


def main(src, dst):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = list(rows(src))
    labels = [f"{c[0]}\n{c[1]}, {c[2]} req" for c in data]
    kernels = [("ours", 5, "tab:green"), ("vLLM 0.25.1", 6, "tab:red"), ("vllm-ascend 0.25.1rc1", 7, "tab:gray")]
    fig, ax = plt.subplots(figsize=(12, 4.5))
    width = 0.27
    for k, (name, col, color) in enumerate(kernels):
        xs, ys = [], []
        for i, c in enumerate(data):
            t, plain = ms(c[col]), ms(c[4])
            if t is not None:
                xs.append(i + (k - 1) * width)
                ys.append(t / plain)
        ax.bar(xs, ys, width, label=name, color=color)
    ax.axhline(1.0, color="black", lw=0.8, ls="--", label="plain copy")
    ax.set_yscale("log")
    ax.set_ylabel("time / plain copy of the same bytes")
    ax.set_xticks(range(len(data)), labels, fontsize=7)
    ax.set_title("\n".join(textwrap.wrap(open(src).readline().strip(), 150)), fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:3])
