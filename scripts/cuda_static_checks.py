#!/usr/bin/env python3
"""Static checks of the CUDA kernels, with nvcc and no GPU: called by scripts/cuda_static_checks.sh.

1. Compiles every csrc/cuda/*.cu with the command of a configured build tree (`ninja -t commands`: the
   project's flags, whatever they are today), to a fatbinary (`-fatbin` for `-c`: the device code is the same,
   nvcc skips the host compile), plus `-Xptxas -v`, and reads ptxas's report of every kernel for sm_90:
   registers, stack frame, spill stores and loads. A hot kernel (HOT below) with a stack frame or a spill fails.
2. Disassembles each fatbinary (cuobjdump -sass) and checks that every vectorized instantiation (a kernel
   templated on `int V`, instantiated with V * sizeof(element) = 16 bytes) has 128-bit global loads and stores
   (LDG.E.128*, STG.E.128*, any further modifiers) and, with STRICT_STORES, no narrower global store (these
   kernels write only through store_vec: a narrower store is a vector store split into elements); and that no
   hot kernel touches local memory (LDL/STL).
3. Prints a table of every kernel and a report (also written to --report) and exits 1 if any check fails.

Only the standard library; c++filt demangles.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import glob
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field

ARCH = "sm_90"

# Hot kernels: those whose work is per element of an op's activation-sized tensor (x, q and k, the
# [B, H, Q, K] attention bias, or the gradient of one of them), read or written once per call. The other
# kernels of csrc/cuda touch per-position, per-diagonal, per-bucket or per-slope data, index tensors, or run
# once per call (positions.cu, frequencies.cu, the T5 bucket tables, the slope sums): they are listed, not held
# to the rule.
HOT = {
    "rotary_kernel": "rope.cu: every rope op (one-axis and multi-axis, backward, in place, rope_cos_sin)",
    "norm_rope_kernel": "qk_norm.cuh: qk_norm_rope, its backward and in-place form",
    "additive_kernel": "additive.cuh: sinusoidal and learned families (x rows, token-table rows, encoding alone)",
    "embedding_backward_kernel": "embedding.cu: embedding_backward (the [rows, D] gradient)",
    "alibi_kernel": "alibi.cu: alibi_bias, add_alibi, add_alibi_",
    "alibi_row_sums_kernel": "alibi.cu: alibi_backward (reads the [B, H, Q, K] gradient)",
    "bias_rows_kernel": "t5.cu: t5_bias (writes [H, Q, K])",
    "diagonal_sums_kernel": "t5.cu: t5_bias_backward (reads the [H, Q, K] gradient)",
}

# Every global store of a vectorized instantiation must be 128-bit (its kernel writes only through store_vec);
# False: one 128-bit store is enough (a kernel may then store its main path element by element unnoticed).
STRICT_STORES = True

# Vectorized kernels whose loads are not vectors by design: only their stores must be 128-bit.
STORES_ONLY = {
    "bias_rows_kernel": "reads its diagonal slices element by element (they start at any element), writes vectors",
}

ELEMENT_BYTES = {"c10::Half": 2, "c10::BFloat16": 2, "float": 4, "double": 8}
VECTOR_BYTES = 16

PTXAS_ENTRY = re.compile(r"ptxas info\s*: Compiling entry function '([^']+)' for '(sm_\d+a?)'")
PTXAS_PROPS = re.compile(r"ptxas info\s*: Function properties for (\S+)")
PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
PTXAS_USED = re.compile(r"ptxas info\s*: Used (\d+) registers(.*)")
SASS_FUNCTION = re.compile(r"^\s*Function : (\S+)")
SASS_ARCH = re.compile(r"^\s*code for (sm_\w+)")
SASS_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)")


@dataclass
class Kernel:
    mangled: str
    source: str
    name: str = ""           # demangled
    short: str = ""          # demangled, namespaces dropped, enums named
    base: str = ""           # the template's name: rotary_kernel
    registers: int = -1
    stack: int = -1
    spill_stores: int = -1
    spill_loads: int = -1
    lmem: int = 0            # "N bytes lmem" where a ptxas prints it
    cumulative: int = 0      # "N bytes cumulative stack size": its frame and those of the functions it calls
    ops: dict = field(default_factory=dict)  # global/local memory opcode -> count
    vector: int | None = None   # V of a kernel templated on it
    element: str | None = None
    failures: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    @property
    def hot(self) -> bool:
        return self.base in HOT

    def count(self, prefix: str, wide: bool | None = None) -> int:
        total = 0
        for op, n in self.ops.items():
            parts = op.split(".")
            if parts[0] != prefix:
                continue
            if wide is None or wide == ("128" in parts[1:]):
                total += n
        return total


def run(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, text=True, capture_output=True, **kw)


# ---- the compile commands of the build tree ----

def cuda_objects(build: str) -> dict[str, str]:
    """csrc/cuda/x.cu -> its object target in the build tree."""
    out = run(["ninja", "-C", build, "-t", "targets", "all"], check=True).stdout
    objects = {}
    for line in out.splitlines():
        target = line.split(":")[0].strip()
        m = re.search(r"(csrc/cuda/[^/]+\.cu)\.o$", target)
        if m and "posenc_cuda.dir" in target:
            objects[m.group(1)] = target
    return objects


def check_command(build: str, target: str, output: str) -> list[str]:
    """The build tree's nvcc command for `target`, writing a fatbinary to `output` (its dependencies to
    `output`.d), with ptxas's report."""
    lines = run(["ninja", "-C", build, "-t", "commands", target], check=True).stdout.strip().splitlines()
    argv = shlex.split(lines[-1])
    while argv and os.path.basename(argv[0]) in ("ccache", "sccache", "distcc"):  # a launcher is no flag
        argv = argv[1:]
    if not argv or "nvcc" not in os.path.basename(argv[0]):
        raise SystemExit(f"cuda_static_checks: {target}: not an nvcc command: {lines[-1]}")
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a in ("-MD", "-MMD"):
            i += 1
        elif a in ("-MT", "-MF", "-o"):
            i += 2
        elif a == "-c":
            out.append("-fatbin")
            i += 1
        else:
            out.append(a)
            i += 1
    if "-fatbin" not in out:
        raise SystemExit(f"cuda_static_checks: {target}: no -c in the build command: {lines[-1]}")
    if not any(ARCH in a or f"arch={ARCH.replace('sm', 'compute')}" in a or a == f"-arch={ARCH}" for a in out):
        raise SystemExit(f"cuda_static_checks: the build tree compiles for no {ARCH} (configure it with CUDAARCHS=90): "
                         f"{lines[-1]}")
    return out + ["-o", output, "-MD", "-MF", output + ".d", "-Xptxas", "-v"]


def up_to_date(argv: list[str], output: str, log: str) -> bool:
    """Whether the last run of this very command left its outputs, newer than every file it read."""
    try:
        if open(log).readline().rstrip("\n") != "$ " + shlex.join(argv):
            return False
        built = os.path.getmtime(output)
        deps = open(output + ".d").read().replace("\\\n", " ").split(":", 1)[1].split()
        return all(os.path.getmtime(d) < built for d in deps + [argv[0]])
    except (OSError, IndexError):
        return False


def compile_one(argv: list[str], output: str, log: str, fresh: bool) -> tuple[int, float, bool]:
    if not fresh and up_to_date(argv, output, log):
        return 0, 0.0, True
    start = time.monotonic()
    with open(log, "w") as f:
        f.write("$ " + shlex.join(argv) + "\n")
        f.flush()
        rc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0 and os.path.exists(output):
        os.remove(output)
    return rc, time.monotonic() - start, False


# ---- ptxas's report and the SASS ----

def parse_ptxas(text: str, source: str) -> tuple[dict[str, Kernel], dict[str, tuple]]:
    """Entry functions of ARCH, and the frames of the functions they call (non-entry, not inlined)."""
    kernels: dict[str, Kernel] = {}
    callees: dict[str, tuple] = {}
    entry = None       # the entry being compiled for ARCH, or None (another architecture)
    arch_ok = False
    props = None       # the function whose properties follow
    for line in text.splitlines():
        m = PTXAS_ENTRY.search(line)
        if m:
            arch_ok = m.group(2) == ARCH
            entry = m.group(1) if arch_ok else None
            if entry:
                kernels[entry] = Kernel(entry, source)
            continue
        if "ptxas info" in line and "Compiling" in line and "for '" in line:  # a non-entry function
            arch_ok = line.rstrip().endswith(f"'{ARCH}'")
            entry = None
            continue
        m = PTXAS_PROPS.search(line)
        if m:
            props = m.group(1)
            continue
        m = PTXAS_FRAME.search(line)
        if m and props is not None:
            frame = tuple(int(x) for x in m.groups())
            if props in kernels and arch_ok:
                k = kernels[props]
                k.stack, k.spill_stores, k.spill_loads = frame
            elif arch_ok:
                callees[props] = frame
            props = None
            continue
        m = PTXAS_USED.search(line)
        if m and entry is not None and entry in kernels:
            k = kernels[entry]
            k.registers = int(m.group(1))
            lm = re.search(r"(\d+) bytes lmem", m.group(2))
            k.lmem = int(lm.group(1)) if lm else 0
            cs = re.search(r"(\d+) bytes cumulative stack size", m.group(2))
            k.cumulative = int(cs.group(1)) if cs else 0
    return kernels, callees


def parse_sass(text: str) -> dict[str, dict]:
    """Function -> {opcode: count} for the global and local memory instructions of ARCH's code."""
    functions: dict[str, dict] = {}
    arch = None
    current = None
    for line in text.splitlines():
        m = SASS_ARCH.match(line)
        if m:
            arch = m.group(1)
            continue
        m = SASS_FUNCTION.match(line)
        if m:
            current = functions.setdefault(m.group(1), {}) if arch in (None, ARCH) else None
            continue
        if current is None:
            continue
        m = SASS_INSTRUCTION.search(line)
        if not m:
            continue
        op = m.group(1)
        head = op.split(".")[0]
        if head in ("LDG", "STG", "LDL", "STL", "LD", "ST"):
            current[op] = current.get(op, 0) + 1
    return functions


# ---- names ----

def demangle(names: list[str]) -> dict[str, str]:
    if not names:
        return {}
    out = run(["c++filt"], input="\n".join(names) + "\n", check=True).stdout.splitlines()
    return dict(zip(names, out))


def split_template_args(name: str, base: str) -> list[str]:
    """The top-level template arguments of `base<...>` in a demangled name."""
    i = name.find(base + "<")
    if i < 0:
        return []
    i += len(base) + 1
    depth, args, cur = 0, [], ""
    while i < len(name):
        c = name[i]
        if c in "<(":
            depth += 1
        elif c in ">)":
            if depth == 0:
                args.append(cur.strip())
                break
            depth -= 1
        if c == "," and depth == 0:
            args.append(cur.strip())
            cur = ""
        else:
            cur += c
        i += 1
    return args


def enums(root: str) -> dict[str, list[str]]:
    """enum class Name { A, B, ... } of the headers (enumerators without values), for readable names."""
    found = {}
    for path in glob.glob(os.path.join(root, "csrc", "**", "*.h"), recursive=True):
        text = open(path, encoding="utf-8", errors="replace").read()
        for m in re.finditer(r"enum class (\w+)\s*(?::\s*\w+\s*)?\{([^}]*)\}", text):
            values = [v.strip() for v in m.group(2).split(",") if v.strip()]
            if all("=" not in v for v in values):
                found[m.group(1)] = values
    return found


def shorten(name: str, enum_values: dict[str, list[str]]) -> str:
    s = name
    for prefix in ("posenc::cuda::(anonymous namespace)::", "posenc::cuda::", "posenc::portable::", "posenc::",
                   "c10::"):
        s = s.replace(prefix, "")

    def named(m):
        values = enum_values.get(m.group(1))
        n = int(m.group(2))
        return values[n] if values and n < len(values) else m.group(0)

    s = re.sub(r"\((\w+)\)(\d+)", named, s)
    s = re.sub(r"\(.*\)$", "", s)  # the parameter list
    s = re.sub(r"^void ", "", s)     # a template's return type
    return s.replace(" >", ">")


def vector_templates(root: str) -> dict[str, tuple[int, int | None]]:
    """Kernels of csrc/cuda templated on `int V`: name -> (position of V, position of the element type)."""
    found = {}
    for path in sorted(glob.glob(os.path.join(root, "csrc", "cuda", "*.cu")) +
                       glob.glob(os.path.join(root, "csrc", "cuda", "*.cuh"))):
        text = open(path, encoding="utf-8").read()
        pattern = r"template\s*<([^>]*)>\s*__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\("
        for m in re.finditer(pattern, text):
            params = [p.strip() for p in m.group(1).split(",")]
            v = [i for i, p in enumerate(params) if re.fullmatch(r"int\s+V", p)]
            if v:
                t = [i for i, p in enumerate(params) if re.fullmatch(r"typename\s+scalar_t", p)]
                found[m.group(2)] = (v[0], t[0] if t else None)
    return found


# ---- the checks ----

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", required=True, help="the source tree")
    ap.add_argument("--build", required=True, help="a build tree configured with POSENC_CUDA=ON, CUDAARCHS=90")
    ap.add_argument("--work", required=True, help="where the fatbinaries, logs and SASS go")
    ap.add_argument("--cuobjdump", required=True)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--report")
    ap.add_argument("--fresh", action="store_true", help="recompile every file, even where its outputs are up to date")
    args = ap.parse_args()
    t0 = time.monotonic()
    root = os.path.abspath(args.root)
    os.makedirs(args.work, exist_ok=True)

    sources = sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "csrc", "cuda", "*.cu")))
    objects = cuda_objects(args.build)
    missing = [s for s in sources if s not in objects]
    if missing:
        raise SystemExit(f"cuda_static_checks: the build tree {args.build} has no object for {missing}")

    # 1. compile, longest first (rope.cu): the files run side by side, args.jobs at a time.
    jobs = []
    for src in sources:
        stem = os.path.basename(src)[:-3]
        fatbin = os.path.join(args.work, stem + ".fatbin")
        log = os.path.join(args.work, stem + ".ptxas.log")
        jobs.append((src, fatbin, log, check_command(args.build, objects[src], fatbin)))
    nvcc = jobs[0][3][0]
    version = [v for v in run([nvcc, "--version"]).stdout.splitlines() if "release" in v]
    print(f"== compile {len(jobs)} files for {ARCH} with the build tree's flags + -Xptxas -v ({args.jobs} at a time)\n"
          f"   {nvcc}: {version[0].strip() if version else '?'}", flush=True)
    compile_seconds = {}
    order = sorted(jobs, key=lambda j: -os.path.getsize(os.path.join(root, j[0])))
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {pool.submit(compile_one, argv, fatbin, log, args.fresh): (src, log)
                   for src, fatbin, log, argv in order}
        failed = []
        for fut in concurrent.futures.as_completed(futures):
            src, log = futures[fut]
            rc, seconds, reused = fut.result()
            compile_seconds[src] = seconds
            state = "up to date (same command, no input changed)" if reused else (
                f"ok in {seconds:.0f} s" if rc == 0 else f"FAILED in {seconds:.0f} s")
            print(f"   {src}: {state}", flush=True)
            if rc != 0:
                failed.append((src, log))
    if failed:
        for src, log in failed:
            print(f"cuda_static_checks: {src} does not compile; the end of {log}:")
            print("".join(open(log).readlines()[-30:]))
        return 1
    t_compile = time.monotonic() - t0

    # 2. ptxas's report and the SASS of every file.
    kernels: dict[str, Kernel] = {}
    callees: dict[str, tuple] = {}
    sass: dict[str, dict] = {}
    for src, fatbin, log, _ in jobs:
        k, c = parse_ptxas(open(log).read(), src)
        kernels.update(k)
        callees.update(c)
        dump = run([args.cuobjdump, "-sass", fatbin])
        if dump.returncode != 0:
            print(f"cuda_static_checks: cuobjdump -sass {fatbin} failed:\n{dump.stderr}")
            return 1
        with open(fatbin[: -len(".fatbin")] + ".sass", "w") as f:
            f.write(dump.stdout)
        sass.update(parse_sass(dump.stdout))

    names = demangle(sorted(set(kernels) | set(callees)))
    enum_values = enums(root)
    vec_templates = vector_templates(root)
    problems = []
    for k in kernels.values():
        k.name = names.get(k.mangled, k.mangled)
        k.short = shorten(k.name, enum_values)
        k.base = re.sub(r"<.*", "", k.short)
        if k.mangled not in sass:
            k.failures.append("no SASS for it in the fatbinary")
            continue
        k.ops = sass[k.mangled]
        if k.base in vec_templates:
            v_at, t_at = vec_templates[k.base]
            targs = split_template_args(k.name, k.base)
            try:
                k.vector = int(targs[v_at])
            except (IndexError, ValueError):
                k.failures.append(f"V not found in its template arguments {targs}")
            if t_at is not None and t_at < len(targs):
                k.element = targs[t_at]

    # ptxas's numbers of every kernel; the rule for the hot ones.
    for k in kernels.values():
        if k.registers < 0 or k.stack < 0:
            k.failures.append("ptxas reported no registers or frame for it")
            continue
        local = k.count("LDL") + k.count("STL")
        # float64 data takes posenc's own double-double sin/cos (portable/libm.h), the exact path rather than the fast
        # one: its instantiations are reported, not held to the rule.
        exact_path = k.element == "double" or "<double>" in k.name
        if k.hot and not exact_path and (k.stack or k.spill_stores or k.spill_loads or k.lmem or k.cumulative or local):
            k.failures.append(f"local memory: {k.stack} bytes stack frame, {k.spill_stores} bytes spill stores, "
                              f"{k.spill_loads} bytes spill loads, {k.cumulative} bytes cumulative stack" +
                              (f", {k.lmem} bytes lmem" if k.lmem else "") +
                              f" (ptxas); {local} LDL/STL instructions (SASS)")
        elif k.stack > 0 or k.spill_stores > 0 or k.spill_loads > 0:
            why = "float64, the exact path" if k.hot else "not hot"
            k.notes.append(f"{k.stack} bytes stack frame, {k.spill_stores}/{k.spill_loads} bytes spilled ({why})")

    # 128-bit accesses of the vectorized instantiations.
    vectorized = []
    for k in kernels.values():
        if k.vector is None or k.vector == 1:
            continue
        size = ELEMENT_BYTES.get(k.element or "")
        if size is None or k.vector * size != VECTOR_BYTES:
            k.failures.append(f"V = {k.vector} of {k.element}: not one {VECTOR_BYTES}-byte vector")
            continue
        vectorized.append(k)
        want_loads = k.base not in STORES_ONLY
        accesses = ", ".join(f"{op} x{n}" for op, n in sorted(k.ops.items()) if op.split(".")[0] in ("LDG", "STG"))
        lacks = []
        if want_loads and k.count("LDG", wide=True) == 0:
            lacks.append("LDG.E.128")
        if k.count("STG", wide=True) == 0:
            lacks.append("STG.E.128")
        narrow_stores = k.count("STG", wide=False)
        if lacks:
            k.failures.append(f"vectorized (V = {k.vector}, {k.element}) but no {' or '.join(lacks)} in its SASS; "
                              f"its global accesses: {accesses or 'none'}")
        elif STRICT_STORES and narrow_stores:
            k.failures.append(f"vectorized (V = {k.vector}, {k.element}) but {narrow_stores} of its "
                              f"{k.count('STG')} global stores are narrower than 128 bits (a vector store split "
                              f"into elements); its global accesses: {accesses}")
    for base in vec_templates:
        if not any(k.base == base for k in vectorized):
            problems.append(f"{base} is templated on V but no vectorized instantiation of it was found in the SASS")
    for base in HOT:
        if not any(k.base == base for k in kernels.values()):
            problems.append(f"hot kernel {base} not found in ptxas's report (renamed? update HOT in {__file__})")

    # ---- the report ----
    lines = []

    def out(s=""):
        lines.append(s)

    def mem(k, prefix):
        wide, all_ = k.count(prefix, True), k.count(prefix)
        return f"{wide}/{all_}"

    ordered = sorted(kernels.values(), key=lambda k: (not k.hot, k.source, k.base, k.short))
    width = max(len(k.short) for k in ordered)
    header = (f"{'kernel':<{width}}  {'hot':3}  {'regs':>4}  {'stack':>5}  {'spill st/ld':>11}  "
              f"{'LDG 128/all':>11}  {'STG 128/all':>11}  {'LDL/STL':>7}  result")
    out(f"== every kernel for {ARCH} (ptxas -v; SASS by cuobjdump -sass), {len(ordered)} in {len(sources)} files")
    out(header)
    for k in ordered:
        vec = ""
        if k.vector and k.vector > 1:
            vec = " (vector)"
        result = "FAIL" if k.failures else ("ok" + vec)
        out(f"{k.short:<{width}}  {'hot' if k.hot else '':3}  {k.registers:>4}  {k.stack:>5}  "
            f"{f'{k.spill_stores}/{k.spill_loads}':>11}  {mem(k, 'LDG'):>11}  {mem(k, 'STG'):>11}  "
            f"{k.count('LDL') + k.count('STL'):>7}  {result}")
    if callees:
        out()
        out("== functions called, not inlined (ptxas's frames)")
        for name, (stack, st, ld) in sorted(callees.items()):
            out(f"{shorten(names.get(name, name), enum_values)}: {stack} bytes stack frame, {st}/{ld} bytes spilled")

    hot = [k for k in ordered if k.hot]
    out()
    out("== hot kernels: " + ", ".join(f"{b} ({HOT[b].split(':')[0]})" for b in HOT))
    out("   (work per element of an activation-sized tensor or its gradient; must not spill or use local memory)")
    by_base = {}
    for k in hot:
        by_base.setdefault(k.base, []).append(k)
    out("   instantiations: all (vectorized); regs: min-max; stack, spill st/ld: max bytes; then, of the vectorized")
    out("   ones, how many have a 128-bit global load, a 128-bit global store, and only 128-bit global stores")
    out(f"{'kernel':<26} {'inst.':>7}  {'regs':>7}  {'stack':>5}  {'spill st/ld':>11}  "
        f"{'LDG.128':>7}  {'STG.128':>7}  {'only STG.128':>12}")
    for base, ks in by_base.items():
        regs = [k.registers for k in ks]
        vec = [k for k in ks if k in vectorized]
        ldg = sum(1 for k in vec if k.count("LDG", True))
        stg = sum(1 for k in vec if k.count("STG", True))
        only = sum(1 for k in vec if k.count("STG", True) and not k.count("STG", False))
        n = len(vec)
        out(f"{base:<26} {f'{len(ks)} ({n})':>7}  {f'{min(regs)}-{max(regs)}':>7}  {max(k.stack for k in ks):>5}  "
            f"{f'{max(k.spill_stores for k in ks)}/{max(k.spill_loads for k in ks)}':>11}  "
            f"{(f'{ldg}/{n}' if base not in STORES_ONLY else 'n/a'):>7}  {f'{stg}/{n}':>7}  {f'{only}/{n}':>12}")
    for base, why in STORES_ONLY.items():
        out(f"   {base}: only its stores must be 128-bit: {why}")

    notes = [(k, n) for k in ordered for n in k.notes]
    if notes:
        out()
        out("== notes (not failures)")
        for k, n in notes:
            out(f"{k.short}: {n}")

    failures = [(k, f) for k in ordered for f in k.failures]
    out()
    if failures or problems:
        out(f"== FAILED: {len(failures) + len(problems)} problem(s)")
        for k, f in failures:
            out(f"{k.short} [{k.source}]: {f}")
            out(f"   {k.name}")
        for p in problems:
            out(p)
    else:
        out(f"== passed: {len(hot)} hot kernels without stack frame, spill or local memory; "
            f"{len(vectorized)} vectorized instantiations with 128-bit global loads (where required) and "
            f"{'only ' if STRICT_STORES else ''}128-bit global stores")
    compiled = {src: t for src, t in compile_seconds.items() if t > 0}
    if compiled:
        longest = max(compiled, key=compiled.get)
        timing = (f"compiled {len(compiled)} of {len(sources)} files in {t_compile:.0f} s ({args.jobs} at a time; "
                  f"longest {longest}, {compiled[longest]:.0f} s)")
    else:
        timing = f"all {len(sources)} files up to date"
    out(f"   {timing}, {time.monotonic() - t0:.0f} s in all; logs, SASS: {args.work}")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.report:
        with open(args.report, "w") as f:
            f.write(text)
    return 1 if failures or problems else 0


if __name__ == "__main__":
    sys.exit(main())
