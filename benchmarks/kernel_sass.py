"""What a kernel's hot loop costs in instructions, from its machine code: no GPU needed.

A kernel that reads at a fraction of HBM bandwidth while its SMs issue every cycle is bound by its instructions, and
the count per loop iteration is the figure to move (YAKV's pass over the scoring codes: ~0.4 instructions issued per
cycle per scheduler at 20 warps per SM, design.md §4). This compiles `kernels/<stem>.cu` for `--arch` through NVRTC
(as the package does at run time, with ptxas's register and spill report), disassembles it with `nvdisasm`, finds the
kernel's hot loop (the innermost loop with an instruction of `--hot`, e.g. `IMMA`) and reports, for each setting in
`--defines` (one compile each):

- `registers`, `spill_bytes`, `smem_bytes` from ptxas, and `blocks_by_regs`: blocks of `--threads` threads that the
  registers let one SM hold (65536 per SM);
- `loop_instructions`: SASS instructions of one iteration of the hot loop, and the count of each opcode family
  (`LDS`, `SHFL`, `IMMA`, `MUFU`, branches, ...).

`nvdisasm` ships with the CUDA toolkit and in the `nvidia-cuda-nvdisasm` wheel (`pip download` it and unzip; it is
not a dependency of the package): pass its path with `--nvdisasm`, or have it on PATH.

    python -m benchmarks.kernel_sass --stem score_codes --kernel code_states_mma_k8_g4 --hot IMMA --threads 128 \\
        --defines "MMA_MIN_BLOCKS_K8=4,MMA_DEPTH_K8=3;MMA_MIN_BLOCKS_K8=5,MMA_DEPTH_K8=3" --nvdisasm PATH
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from benchmarks.results_io import add_results_dir_option, environment, write_results
from benchmarks.speed import log
from shadowkv_cache.ops.loader import OPTIONS, source_dir

FAMILIES = ("LDS", "STS", "LDG", "STG", "LDGSTS", "SHFL", "IMMA", "HMMA", "MUFU", "PRMT", "LEA", "SEL", "FMNMX")


def compile_with_report(folder: Path, stem: str, arch: str, defines: list[tuple[str, str]]) -> tuple[bytes, str]:
    """The cubin of `<folder>/<stem>.cu` for `arch` with `defines`, and ptxas's verbose report."""
    from cuda.bindings import nvrtc

    source = (folder / f"{stem}.cu").read_text()
    headers = {p.name: p.read_text() for p in sorted(folder.glob("*.cuh"))}
    options = [f"--gpu-architecture={arch}", *OPTIONS, *[f"-D{k}={v}" for k, v in defines], "--ptxas-options=-v"]
    err, prog = nvrtc.nvrtcCreateProgram(
        source.encode(), f"{stem}.cu".encode(), len(headers), [v.encode() for v in headers.values()],
        [k.encode() for k in headers],
    )  # fmt: skip
    try:
        status = nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])[0]
        size = nvrtc.nvrtcGetProgramLogSize(prog)[1]
        report = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, report)
        if int(status) != 0:
            raise SystemExit(f"NVRTC could not compile {stem}.cu:\n{report.decode(errors='replace')}")
        cubin = b" " * nvrtc.nvrtcGetCUBINSize(prog)[1]
        nvrtc.nvrtcGetCUBIN(prog, cubin)
        return cubin, report.decode(errors="replace")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def ptxas_figures(report: str, kernel: str) -> dict:
    """Registers, spill bytes and static shared memory of `kernel` from ptxas's report."""
    lines = report.splitlines()
    for i, line in enumerate(lines):
        if f"Compiling entry function '{kernel}'" in line:
            block = "\n".join(lines[i : i + 4])
            regs = re.search(r"Used (\d+) registers", block)
            spill = re.search(r"(\d+) bytes spill stores", block)
            smem = re.search(r"(\d+) bytes smem", block)
            return {
                "registers": int(regs.group(1)) if regs else None,
                "spill_bytes": int(spill.group(1)) if spill else 0,
                "smem_bytes": int(smem.group(1)) if smem else 0,
            }
    raise SystemExit(f"ptxas reported no kernel named {kernel!r}")


def hot_loop(sass: str, kernel: str, hot: str) -> list[str]:
    """The instructions of `kernel`'s innermost loop (a label and a later branch back to it) with a `hot` one."""
    marker = f".text.{kernel}:"
    if marker not in sass:
        raise SystemExit(f"nvdisasm found no kernel named {kernel!r}")
    section = sass.split(marker, 1)[1].split(".section", 1)[0]
    labels, instrs = {}, []
    for line in section.splitlines():
        label = re.match(r"^\s*\.(L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(instrs)
            continue
        ins = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if ins:
            instrs.append(ins.group(1))
    best: list[str] = []
    for i, ins in enumerate(instrs):
        back = re.search(r"BRA\b.*\.(L_x_\d+)", ins)
        if back and back.group(1) in labels and labels[back.group(1)] <= i:
            body = instrs[labels[back.group(1)] : i + 1]
            if any(hot in x for x in body) and (not best or len(body) < len(best)):
                best = body  # the innermost loop that holds a hot instruction
    return best


def opcode(ins: str) -> str:
    words = ins.split()
    return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stem", default="score_codes")
    p.add_argument("--kernel", default="code_states_mma_k8_g4")
    p.add_argument("--hot", default="IMMA", help="the instruction that marks the hot loop")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--defines", default="", help="settings to compile, ';'-separated, each 'NAME=value,...'")
    p.add_argument("--threads", type=int, default=128, help="threads per block (for blocks_by_regs)")
    p.add_argument("--sources", default="",
                   help="kernel folders to compare, 'label=path,...' (e.g. an older commit's kernels/ from git show); "
                        "default: the package's own")  # fmt: skip
    p.add_argument("--nvdisasm", default=shutil.which("nvdisasm"), help="path to nvdisasm")
    p.add_argument("--name", default=None)
    add_results_dir_option(p)
    args = p.parse_args(argv)
    if not args.nvdisasm or not os.access(args.nvdisasm, os.X_OK):
        raise SystemExit(
            "kernel_sass needs nvdisasm: pass --nvdisasm PATH (it ships with the CUDA toolkit, or `pip download "
            "nvidia-cuda-nvdisasm` and unzip the wheel)."
        )
    settings = [s for s in args.defines.split(";") if s.strip()] or [""]
    sources = [tuple(x.split("=", 1)) for x in args.sources.split(",") if x.strip()] or [("this tree", source_dir())]
    rows = []
    for (label, folder), setting in [(src, s) for src in sources for s in settings]:
        defines = [tuple(kv.split("=", 1)) for kv in setting.split(",") if kv.strip()]
        cubin, report = compile_with_report(Path(folder), args.stem, args.arch, defines)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "k.cubin"
            path.write_bytes(cubin)
            sass = subprocess.run([args.nvdisasm, "-c", str(path)], capture_output=True, text=True, check=True).stdout
        loop = hot_loop(sass, args.kernel, args.hot)
        counts = collections.Counter(opcode(x) for x in loop)
        figures = ptxas_figures(report, args.kernel)
        regs = figures["registers"] or 1
        row = {
            "source": label,
            "setting": setting or "defaults",
            **figures,
            "blocks_by_regs": 65536 // (regs * args.threads),
            "loop_instructions": len(loop),
            "branches": counts.get("BRA", 0) + counts.get("BSSY", 0) + counts.get("BSYNC", 0),
            **{f: counts.get(f, 0) for f in FAMILIES},
        }
        rows.append(row)
        log(row)
    columns = ["source", "setting", "registers", "spill_bytes", "smem_bytes", "blocks_by_regs", "loop_instructions"]
    columns.append("branches")
    columns += list(FAMILIES)
    name = args.name or f"kernel_sass_{args.stem}"
    write_results(
        name,
        f"{args.kernel}: SASS instructions of its hot loop ({args.arch})",
        {**environment("none", "n/a"), "arch": args.arch, "kernel": args.kernel},
        rows,
        columns,
        {"x": "registers", "y": "loop_instructions", "series": "source"},
        notes=__doc__.split("\n\n")[1].replace("\n", " "),
    )


if __name__ == "__main__":
    main()
