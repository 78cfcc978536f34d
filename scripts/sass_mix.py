#!/usr/bin/env python3
"""The instruction mix of a GPU forward kernel's key-tile loop, read from its SASS (no GPU needed).

For each spec: `attnc emit --emit ptx`, ptxas (registers, spills), nvdisasm, then the loop that
holds the most tensor-core instructions (HMMA): how many instructions one pass of it issues per
warp, by opcode. A pass is one key tile for one warp, so "issue slots per HMMA" says how far the
kernel is from being bound by its tensor cores rather than by instruction issue.

Needs the toolchain of scripts/setup-cuda-toolchain.sh (ptxas and nvdisasm in .cuda-toolchain/bin)
and an attnc built with `--features llvm`.

Usage: scripts/sass_mix.py [--arch sm_90] [--attnc target/release/attnc] [--top 12] SPEC...
"""

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, ".cuda-toolchain", "bin")
LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def instructions(sass):
    """(address, text without predicate) of every instruction, branch targets as addresses
    (nvdisasm names them by labels, which precede the instruction they mark)."""
    out, labels, pending = [], {}, []
    for line in sass.splitlines():
        label = re.match(r"^(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        m = LINE.search(line)
        if not m:
            continue
        addr = int(m.group(1), 16)
        labels.update((name, addr) for name in pending)
        pending.clear()
        out.append((addr, m.group(2).strip()))
    return [(a, re.sub(r"`\((\.L_x_\d+)\)", lambda m: hex(labels.get(m.group(1), -1)), t))
            for a, t in out]


def unpredicated(text):
    return re.sub(r"^@!?U?P[0-9T]+\s+", "", text)


def opcode(text):
    return unpredicated(text).split()[0].split(".")[0]


def hottest_loop(code):
    """(address, text) of the instructions between a backward branch and its target, for the
    branch whose range holds the most HMMA."""
    best = (0, [])
    for addr, text in code:
        target = branch_target(text)
        if target is None or target > addr:
            continue
        body = [(a, t) for a, t in code if target <= a <= addr]
        hmma = sum(opcode(t) == "HMMA" for _, t in body)
        if hmma > best[0]:
            best = (hmma, body)
    return best[1]


def branch_target(text):
    target = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
    return int(target.group(1), 16) if target else None


def steady_state(loop):
    """The fewest instructions on a path through the loop that runs all of its HMMA and commits
    one group of copies (LDGDEPBAR): a full key tile whose next tile's copies are in flight,
    with no mask applied. Inner loops (backward branches other than the last) count once."""
    index = {a: i for i, (a, _) in enumerate(loop)}
    last = len(loop) - 1
    best = {}  # (i, need_copies) -> (hmma, -count, opcode counts) from i to the back edge

    def successors(i):
        text = loop[i][1]
        target = branch_target(text)
        op = opcode(text)
        if op == "EXIT" and text == unpredicated(text):
            return []
        out = []
        if target is not None and target > loop[i][0] and target in index:
            out.append(index[target])
        if not (op == "BRA" and text == unpredicated(text)):
            out.append(i + 1)
        return out

    for i in range(last, -1, -1):
        op = opcode(loop[i][1])
        here = collections.Counter([op])
        for need in (False, True):
            rest = need and op != "LDGDEPBAR"
            if i == last:
                best[(i, need)] = None if rest else (int(op == "HMMA"), -1, here)
                continue
            options = [best[(j, rest)] for j in successors(i) if j <= last]
            options = [o for o in options if o is not None]
            if not options:
                best[(i, need)] = None
                continue
            h, c, mix = max(options, key=lambda o: (o[0], o[1]))
            best[(i, need)] = (h + int(op == "HMMA"), c - 1, mix + here)
    path = best[(0, True)]
    return path[2] if path else collections.Counter()


def run(cmd, **kw):
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw)


def analyse(spec, args, tmp):
    ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
    run([args.attnc, "emit", spec, "--target", args.arch, "--emit", "ptx", "-o", ptx])
    report = run([os.path.join(TOOLS, "ptxas"), f"-arch={args.arch}", "-O3", "-v", ptx, "-o", cubin])
    regs = re.search(r"Used (\d+) registers", report.stderr)
    spill = re.search(r"(\d+) bytes spill stores", report.stderr)
    sass = run([os.path.join(TOOLS, "nvdisasm"), "-c", cubin]).stdout
    loop = hottest_loop(instructions(sass))
    mix = collections.Counter(opcode(t) for _, t in loop)
    return {
        "steady": steady_state(loop),
        "regs": int(regs.group(1)) if regs else None,
        "spill": int(spill.group(1)) if spill else None,
        "loop": len(loop),
        "mix": mix,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="sm_90", choices=["sm_80", "sm_90"])
    p.add_argument("--attnc", default=os.path.join(ROOT, "target", "release", "attnc"))
    p.add_argument("--top", type=int, default=12, help="opcodes listed per spec")
    p.add_argument("specs", nargs="+", metavar="SPEC")
    args = p.parse_args()
    for tool in [args.attnc, os.path.join(TOOLS, "ptxas"), os.path.join(TOOLS, "nvdisasm")]:
        if not os.access(tool, os.X_OK):
            sys.exit(f"error: {tool} is missing: run scripts/setup-cuda-toolchain.sh and "
                     "cargo build --release --features llvm --bin attnc")
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.specs:
            try:
                r = analyse(spec, args, tmp)
            except subprocess.CalledProcessError as e:
                sys.exit(f"error: {' '.join(e.cmd[:2])} failed on {spec!r}:\n{e.stderr}")
            hmma = r["mix"].get("HMMA", 0)
            steady = sum(r["steady"].values())
            per = f"{(steady - hmma) / hmma:.2f}" if hmma else "-"
            print(f"{spec}  [{args.arch}]")
            print(f"  {r['regs']} registers, {r['spill']} B spilled; key-tile loop: {r['loop']} "
                  f"instructions, {hmma} HMMA")
            if not steady:
                print("  no path through the loop runs every HMMA and a copy group "
                      "(ptxas placed part of it outside the loop's range)")
                continue
            print(f"  a full tile in the steady state issues {steady} per warp, "
                  f"{per} others per HMMA:")
            top = ", ".join(f"{op} {n}" for op, n in r["steady"].most_common(args.top))
            print(f"  {top}")


if __name__ == "__main__":
    main()
