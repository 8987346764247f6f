"""Checks that run before lycoris_ops._C is loaded, because loading it cannot fail safely.

_C is compiled against one torch (an ABI mismatch can crash at load), and it registers the
``lycoris`` operator namespace while the shared object loads, where a clash with an existing
registration terminates the process instead of raising. Each check raises ImportError with
what to do instead.
"""
from __future__ import annotations

import importlib.metadata
import re
import sys

import torch

NAMESPACE = "lycoris"
#: the command that rebuilds _C against the installed torch (the build backend asks for it)
REBUILD = "pip install --no-deps --force-reinstall ."


def check_torch_matches_build(built_against: str) -> None:
    """``built_against``: the ``torch.__version__`` that _C was compiled with (setup.py records
    it in _build_info.py). The whole string must match: its release part names the C++ API
    and ABI (neither is kept across torch releases, nor between nightly builds), its local
    label (``+cpu``, ``+cu130``) the flavour of libtorch that _C links against."""
    if torch.__version__ != built_against:
        raise ImportError(
            f"lycoris_ops._C was compiled against torch {built_against}, but this process runs torch "
            f"{torch.__version__}; a C++ extension works only with the torch it was compiled against, so "
            f"_C was not loaded. Rebuild lycoris_ops against the installed torch; from its source folder:\n"
            f"    {REBUILD}\n"
            "(add -e for an editable install; add --no-build-isolation to build with this environment's "
            "setuptools, wheel and ninja)"
        )


def _holdings() -> list[str]:
    """What already holds the lycoris namespace in this process, one line each; empty: free.

    A ``TORCH_LIBRARY`` / ``Library(ns, "DEF")`` claim shows only by trying to claim the
    namespace (a RuntimeError that names the earlier claim; the trial claim is released at
    once); operators defined or given kernels through fragments (``torch.library.custom_op``
    among them) show in the dispatcher's table of operator names."""
    held = []
    try:
        torch.library.Library(NAMESPACE, "DEF")._destroy()
    except RuntimeError as exc:
        site = re.search(r"Previous registration of TORCH_LIBRARY was registered at (.+?);", str(exc))
        held.append(f"the namespace, claimed at {site.group(1) if site else '(unknown)'}")
    ops = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith(f"{NAMESPACE}::"))
    if ops:
        sites = sorted({s for op in ops for s in re.findall(r"registered at (\S+)", torch._C._dispatch_dump(op))})
        shown = ", ".join(ops[:3]) + (f" and {len(ops) - 3} more" if len(ops) > 3 else "")
        held.append(f"{len(ops)} operator(s) ({shown}), registered at {', '.join(sites[:3]) or '(unknown)'}")
    return held


def _lycoris_lora() -> str:
    """'lycoris-lora <version> (<path>)' where lycoris-lora's package is imported, else ''."""
    module = sys.modules.get("lycoris")
    if module is None:
        return ""
    try:
        version = importlib.metadata.version("lycoris-lora")
    except importlib.metadata.PackageNotFoundError:
        version = "(version unknown)"
    return f"lycoris-lora {version} ({getattr(module, '__file__', None) or 'lycoris'})"


def check_namespace_free() -> None:
    """Raise ImportError where anything already registered the lycoris operator namespace
    (lycoris-lora 4.x does on ``import lycoris``: the same op names, other schemas)."""
    held = _holdings()
    if not held:
        return
    lora = _lycoris_lora()
    if lora:
        holder = f"{lora}, imported before lycoris_ops,"
        remedy = (f"Import lycoris_ops before lycoris (it then serves lycoris-lora's {NAMESPACE} kernels itself), "
                  "or use the two in separate processes.")
    else:
        holder, remedy = "code that ran before", "Import lycoris_ops before that code, or run them in separate processes."
    raise ImportError(
        f"lycoris_ops defines the torch.ops.{NAMESPACE} operators, and {holder} already registered that "
        f"namespace:\n    " + "\n    ".join(held) + f"\n{remedy}"
    )
