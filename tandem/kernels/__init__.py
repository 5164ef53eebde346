"""tandem's C kernels (the sources in this folder) and how they are compiled, cached and loaded: the hf engine's
decode step, attention and sampling draw (`tandem.rollout.native`), and CPU training's fused SiLU-gate and RMS
norm (`tandem.train.fused`). Each library is compiled with the machine's C compiler on first use, cached per
source, flags, compiler and processor, and called through ctypes.

Why C and ctypes rather than a PyTorch C++ extension: the kernels need raw pointers and strides, nothing of ATen,
and a plain C file compiles in well under a second where a file that includes the ATen headers takes tens of
seconds (every user's first run would pay it). Why compile on the user's machine: `-march=native` lets the
compiler use every vector unit the processor has (AVX2, AVX-512, NEON) from one portable source; the cache key
includes the processor's feature flags, so a home directory shared by unlike machines holds one build for each.
No compiler, or a failed build, leaves PyTorch ops in use wherever a kernel would run.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

KERNELS = Path(__file__).parent  # the C sources, shipped as package data
# fast-math's reassociation only (the dot products' partial sums vectorize); no finite-math assumption, since
# masked scores are -inf
FLAGS = ["-O3", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math", "-fPIC",
         "-shared"]
# Tried in this order, the first that builds kept: `-march=native` for every vector unit the processor has, OpenMP
# for threads (libgomp.so.1: PyTorch's own, already loaded, so the kernel's threads are torch's pool); a compiler
# without either still builds one (single-threaded, or for the baseline of its target)
VARIANTS = [["-march=native", "-fopenmp"], ["-fopenmp"], ["-march=native"], []]


def processor() -> str:
    """The processor's name and feature flags: what a `-march=native` build depends on."""
    text = ""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        pass
    lines = [ln for ln in text.splitlines() if ln.split(":")[0].strip() in ("flags", "Features", "model name")]
    return "\n".join([platform.machine(), platform.processor(), *sorted(set(lines))])


def cache_dir() -> Path:
    """TANDEM_KERNEL_CACHE, else $XDG_CACHE_HOME/tandem/kernels (~/.cache/tandem/kernels)."""
    if os.environ.get("TANDEM_KERNEL_CACHE"):
        return Path(os.environ["TANDEM_KERNEL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tandem" / "kernels"


def compiler() -> str | None:
    """$CC, else the first of cc, gcc, clang on the PATH; None without one."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _build(cc: str, flags: list[str], source: Path, target: Path) -> str | None:
    """Compile `source` into `target` (written whole or not at all: processes may build at once) with the first
    of VARIANTS that builds; None, or why the last failed."""
    target.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    for variant in VARIANTS:
        fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
        os.close(fd)
        try:
            done = subprocess.run([cc, *variant, *flags, str(source), "-o", tmp, "-lm"], capture_output=True,
                                  text=True, timeout=120)
            if done.returncode == 0:
                os.replace(tmp, target)
                return None
            errors.append(done.stderr.strip()[-500:])
        except (OSError, subprocess.SubprocessError) as e:
            errors.append(str(e))
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return f"{cc} failed: {errors[-1]}"


def built(name: str, source: Path, includes: list[Path], flags: list[str]) -> tuple[ctypes.CDLL | None, str]:
    """`source` (which includes `includes`) compiled with `flags`, cached as `name`-<key>.so, loaded; or None and
    why not. The key covers the sources, the flags, the compiler and the processor."""
    cc = compiler()
    if cc is None:
        return None, "no C compiler (set CC, or install gcc or clang)"
    texts = [f.read_bytes() for f in (source, *includes)]
    key = hashlib.sha256(b"\0".join([*texts, " ".join(flags).encode(), cc.encode(),
                                      processor().encode()])).hexdigest()[:16]
    target = cache_dir() / f"{name}-{key}.so"
    if not target.exists():
        why = _build(cc, flags, source, target)
        if why:
            return None, why
    try:
        return ctypes.CDLL(str(target)), ""
    except OSError as e:
        return None, f"loading {target}: {e}"
