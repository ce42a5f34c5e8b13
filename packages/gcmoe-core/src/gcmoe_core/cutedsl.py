"""CuTe DSL plumbing shared by the kernel packages: target arch, compile (no GPU needed), on-disk cache, and the
cubin's SASS and resources for the offline checks.

CuTe DSL is imported lazily: packages that only prepack weights work without it. Before the first import we point
the DSL's own file cache at GCMOE_CACHE_DIR/cute-dsl (unless CUTE_DSL_CACHE_DIR is set); the DSL keys that cache on
the kernel source, its arguments and the compile options (arch included).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sysconfig
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from . import env

ARCHS = ("sm_90a", "sm_100a", "sm_103a")


def target_arch(device: int | None = None) -> str:
    """GCMOE_ARCH if set, else the arch of the current CUDA device; ValueError if neither says."""
    forced = os.environ.get("GCMOE_ARCH")
    if forced:
        if forced not in ARCHS:
            raise ValueError(f"GCMOE_ARCH={forced!r} is not one of {ARCHS}")
        return forced
    import torch

    if not torch.cuda.is_available():
        raise ValueError("no CUDA device to read the arch from: set GCMOE_ARCH (sm_90a, sm_100a or sm_103a)")
    major, minor = torch.cuda.get_device_capability(device)
    return {(9, 0): "sm_90a", (10, 0): "sm_100a", (10, 3): "sm_103a"}.get((major, minor), f"sm_{major}{minor}")


@cache
def cutlass_modules():
    """(cutlass, cute) imported once, with the DSL cache placed under GCMOE_CACHE_DIR."""
    os.environ.setdefault("CUTE_DSL_CACHE_DIR", str(env.cache_dir() / "cute-dsl"))
    import cutlass
    import cutlass.cute as cute

    return cutlass, cute


def dsl_version() -> str | None:
    """The installed nvidia-cutlass-dsl version (the module's own when there is no distribution record), None when
    it is not importable. Does not import the DSL when the distribution is installed."""
    from importlib import metadata

    try:
        return metadata.version("nvidia-cutlass-dsl")
    except metadata.PackageNotFoundError:
        try:
            cutlass, _ = cutlass_modules()
        except Exception:
            return None
        return getattr(cutlass, "__version__", "importable (version unknown)")


def dsl_available() -> str | None:
    """None when CuTe DSL imports, else why not."""
    try:
        cutlass_modules()
    except Exception as e:  # ImportError, or a broken install
        return f"nvidia-cutlass-dsl not importable ({type(e).__name__}: {e})"
    return None


@dataclass
class CompiledKernel:
    name: str
    arch: str
    fn: object  # the DSL's compiled callable
    cubin: bytes | None
    ptx: str | None = None

    def __call__(self, *args):
        return self.fn(*args)

    def sass(self) -> str:
        return disassemble(self.cubin)

    def resources(self) -> dict[str, int]:
        return resource_usage(self.cubin)


def compile_kernel(jit_fn, *args, arch: str, name: str, extra_options: str = "") -> CompiledKernel:
    """cute.compile for `arch` (no GPU needed), keeping the cubin for inspection."""
    if arch not in ARCHS:
        raise ValueError(f"arch {arch!r} is not one of {ARCHS}")
    _, cute = cutlass_modules()
    dump = Path(tempfile.mkdtemp(prefix=f"gcmoe-{name}-"))
    try:
        opts = f"--gpu-arch {arch} --keep-cubin --keep-ptx --dump-dir {dump} {extra_options}"
        fn = cute.compile(jit_fn, *args, options=opts)
        cubin = fn.artifacts.CUBIN if getattr(fn, "artifacts", None) is not None else None
        if cubin is None:
            found = sorted(dump.glob("*.cubin"))
            cubin = found[0].read_bytes() if found else None
        ptx_files = sorted(dump.glob("*.ptx"))
        ptx = ptx_files[0].read_text() if ptx_files else None
    finally:
        shutil.rmtree(dump, ignore_errors=True)
    return CompiledKernel(name, arch, fn, cubin, ptx)


@cache
def cuda_tool(name: str) -> str:
    """Path of nvdisasm / cuobjdump: the nvidia-cuda-* wheels first, then PATH and CUDA_HOME."""
    purelib = Path(sysconfig.get_paths()["purelib"])
    for cand in (
        purelib / "nvidia" / "cu13" / "bin" / name,
        purelib / "nvidia" / "cuda_nvdisasm" / "bin" / name,
        purelib / "nvidia" / "cuda_cuobjdump" / "bin" / name,
    ):
        if cand.is_file():
            return str(cand)
    found = shutil.which(name)
    if found:
        return found
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    if (Path(home) / "bin" / name).is_file():
        return str(Path(home) / "bin" / name)
    raise FileNotFoundError(f"{name} not found: install nvidia-cuda-nvdisasm / nvidia-cuda-cuobjdump or a CUDA toolkit")


def _with_cubin_file(cubin: bytes, argv: list[str]) -> str:
    if not cubin:
        raise ValueError("no cubin to inspect")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([*argv, f.name], capture_output=True, text=True, check=True).stdout


def disassemble(cubin: bytes) -> str:
    return _with_cubin_file(cubin, [cuda_tool("nvdisasm"), "-c"])


def resource_usage(cubin: bytes) -> dict[str, int]:
    """Registers, stack, shared and local bytes per kernel (max over kernels in the cubin), from cuobjdump."""
    out = _with_cubin_file(cubin, [cuda_tool("cuobjdump"), "--dump-resource-usage"])
    usage: dict[str, int] = {}
    for key, val in re.findall(r"\b(REG|STACK|SHARED|LOCAL|TEXTURE|SURFACE|SAMPLER):(\d+)", out):
        usage[key] = max(usage.get(key, 0), int(val))
    return usage


SASS_OP = r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?"  # an instruction line up to its opcode (address, predicate)


def sass_opcodes(sass: str) -> set[str]:
    """Opcode mnemonics (with their modifiers) that appear in a SASS listing."""
    return set(re.findall(SASS_OP + r"([A-Z][A-Z0-9_.]+)", sass, flags=re.M))


def as_cute(t, dynamic_mode: int | None = 0, assumed_align: int | None = None, element_type=None):
    """A torch tensor as the CuTe tensor a kernel compiled against `make_fake_compact_tensor` expects: mode
    `dynamic_mode` dynamic (compact layout, that extent passed at run time), or fully static when None.
    element_type reinterprets the elements (e.g. uint8 storage as Float8E4M3FN, independent of the torch build's
    DLPack support for FP8)."""
    from cutlass.cute.runtime import from_dlpack

    cutlass_modules()
    ct = from_dlpack(t, assumed_align=assumed_align)
    if dynamic_mode is not None:
        ct = ct.mark_compact_shape_dynamic(mode=dynamic_mode, stride_order=t.dim_order())
    if element_type is not None:
        ct.element_type = element_type
    return ct
