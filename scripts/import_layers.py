#!/usr/bin/env python3
"""Checks that imports run one way in the Rust crates (issue 28).

For each crate's src/, every file is a node and every `crate::...` / `super::...` path it
names is an edge to the file that defines the module. Reports:
  - import circles (strongly connected components) of more than two files; none are allowed;
  - in pdgate-gateway, every edge that goes up the stage order (STAGES below); none allowed.
Also prints which stage imports which. Exit status 1 if either is found. `-v` prints every
edge.

    python3 scripts/import_layers.py [-v]
"""
import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates")
CRATES = ["pdgate-gateway", "pdgate-core"]
# pdgate-gateway's stages, top first: a file may use its own stage and those after it.
STAGES = ["app", "edge", "admit", "exec", "fleet", "clients", "observe", "render", "request_id", "prompt_ids"]
MAX_CIRCLE = 2

IDENT_PATH = r"((?:[A-Za-z_][A-Za-z0-9_]*::)*[A-Za-z_][A-Za-z0-9_]*)"


def modules(src_dir):
    files = {}
    for d, _, names in os.walk(src_dir):
        for f in names:
            if not f.endswith(".rs"):
                continue
            path = os.path.join(d, f)
            parts = tuple(os.path.relpath(path, src_dir)[:-3].split(os.sep))
            if parts[-1] in ("mod", "lib", "main"):
                parts = parts[:-1]
            files[parts] = path
    return files


def expand(prefix, s):
    """`a::{b, c::{d}}` -> [[a, b], [a, c, d]]."""
    s = s.strip()
    m = re.match(r"^([A-Za-z0-9_:]*?)(::)?\{(.*)\}$", s, re.S)
    if m:
        pre = [p for p in m.group(1).split("::") if p]
        items, cur, depth = [], "", 0
        for ch in m.group(3):
            depth += ch == "{"
            depth -= ch == "}"
            if ch == "," and depth == 0:
                items.append(cur)
                cur = ""
            else:
                cur += ch
        items.append(cur)
        return [q for it in items if it.strip() for q in expand(prefix + pre, it)]
    s = re.sub(r"\s+as\s+\w+$", "", s)
    return [prefix + [p for p in s.split("::") if p and p != "self"]]


def edges_of(files):
    def resolve(path):
        for n in range(len(path), 0, -1):
            if tuple(path[:n]) in files:
                return tuple(path[:n])
        return None

    edges = {k: set() for k in files}
    for k, p in files.items():
        src = re.sub(r"//[^\n]*", "", open(p, encoding="utf-8").read())
        # a file's `super` is its parent module (for mod.rs too: the folder's parent)
        parent = list(k[:-1])
        paths = []
        for m in re.finditer(r"\buse\s+crate::([^;]*);", src, re.S):
            paths += expand([], m.group(1))
        for m in re.finditer(r"\bcrate::" + IDENT_PATH, src):
            paths.append(m.group(1).split("::"))
        # `super` inside a file's inline `mod tests` is the file itself: read only what precedes it
        outer = src.split("mod tests {")[0]
        for m in re.finditer(r"\buse\s+super::([^;]*);", outer, re.S):
            paths += [parent + q for q in expand([], m.group(1))]
        for m in re.finditer(r"(?<!::)\bsuper::" + IDENT_PATH, outer):
            if not m.group(1).startswith("super"):
                paths.append(parent + m.group(1).split("::"))
        for q in paths:
            t = resolve(q)
            if t and t != k:
                edges[k].add(t)
    return edges


def circles(edges):
    sys.setrecursionlimit(10000)
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(comp)

    for v in edges:
        if v not in index:
            visit(v)
    return sorted((c for c in out if len(c) > 1), key=len, reverse=True)


def name(k):
    return "/".join(k) or "lib"


def main():
    verbose = "-v" in sys.argv
    bad = False
    for crate in CRATES:
        files = modules(os.path.join(ROOT, crate, "src"))
        edges = edges_of(files)
        found = circles(edges)
        print(f"{crate}: {len(files)} files, {sum(map(len, edges.values()))} imports, circles of >1 file: {[len(c) for c in found]}")
        for c in found:
            flag = "  TOO BIG" if len(c) > MAX_CIRCLE else ""
            print(f"  circle of {len(c)}{flag}: {' '.join(sorted(map(name, c)))}")
            bad |= len(c) > MAX_CIRCLE
        if crate == "pdgate-gateway":
            rank = lambda k: STAGES.index(k[0]) if k and k[0] in STAGES else -1
            up = [(a, b) for a in sorted(edges) for b in sorted(edges[a]) if rank(a) >= 0 and rank(b) >= 0 and rank(b) < rank(a)]
            stage_edges = {}
            for a in edges:
                for b in edges[a]:
                    if rank(a) >= 0 and rank(b) >= 0 and a[0] != b[0]:
                        stage_edges.setdefault(a[0], set()).add(b[0])
            print("  stage imports:")
            for s in STAGES:
                if s in stage_edges:
                    print(f"    {s} -> {' '.join(x for x in STAGES if x in stage_edges[s])}")
            print(f"  imports up the stage order ({' > '.join(STAGES)}): {len(up)}")
            for a, b in up:
                print(f"    {name(a)} -> {name(b)}")
            bad |= bool(up)
        if verbose:
            for k in sorted(edges):
                print(f"  {name(k)} -> {' '.join(sorted(map(name, edges[k])))}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
