"""``python -m lycoris_ops``: what this installation would do.

Prints the versions (torch, triton, tilelang, lycoris_ops), the devices, the
available and fused backends per device, the environment settings, the tuning
table path, and the 23 ops with the backend each would take for a sample call
(the first case of ``lycoris_ops.testing``, moved to each device; nothing runs).

Options: ``--no-samples`` skips the op table; ``--why`` adds, per device, why each
tier that takes no calls there is unavailable (not installed, no CUDA device, Triton
usable only through its interpreter, ...) and, per op, the tiers its sample call skips
and why.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import sys


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


def _devices(torch):
    devs = [torch.device("cpu")]
    try:
        if torch.cuda.is_available():
            devs += [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    except Exception:
        pass
    return devs


def _describe(torch, dev) -> str:
    if dev.type != "cuda":
        return str(dev)
    p = torch.cuda.get_device_properties(dev)
    return f"{dev}  {p.name}  sm_{p.major}{p.minor}  {p.multi_processor_count} SMs  {p.total_memory / 2**30:.0f} GiB"


def _no_cuda(torch) -> str:
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return f"no CUDA device (torch {torch.__version__} is built without CUDA)"
    return "no CUDA device (torch.cuda.is_available() is False: no driver or no visible GPU)"


def unavailable(torch, dispatch, name: str, dev) -> str:
    """Why tier ``name`` takes no calls on ``dev`` ('' when it does): the device-level
    reasons of ``dispatch.serves``, in words."""
    from lycoris_ops.backends import scope

    error = dispatch.probe_error(name)
    if error:
        return f"not installed ({error})" if "No module named" in error else error
    demoted = dispatch.demotions().get((name, dev))
    if demoted:
        return f"demoted after an error: {demoted}"
    setting = dispatch.backend_setting()
    named = setting == name
    if setting != "auto" and not named and (name in dispatch.FUSED or
                                            dispatch.ORDER.index(name) < dispatch.ORDER.index(setting)):
        return f"{dispatch.ENV_BACKEND} / set_backend names {setting}"
    if name in dispatch.FUSED:
        module = dispatch.opset(name)
        if module is None:
            return f"its op set does not import ({dispatch.opset_error(name)})"
        types = dispatch.device_types(module)
        if dev.type not in types:
            why = f"its op set runs on {', '.join(types)} tensors only"
            if "cuda" in types and not torch.cuda.is_available():
                why = f"{_no_cuda(torch)}; {why}"
            if name == "triton" and dev.type == "cpu":
                why += ("; Triton itself is installed, but on CPU it runs only under its interpreter "
                        "(TRITON_INTERPRET=1, for tests), which the op set does not take")
            return why
        need = getattr(module, "MIN_CAPABILITY", scope.MIN_CAPABILITY.get(name))
        have = dispatch.capability(dev)
        if dev.type == "cuda" and need is not None and not named and have < tuple(need):
            return f"needs sm_{need[0]}{need[1]} or newer, {dev} is sm_{have[0]}{have[1]} (name it to use it anyway)"
        return ""
    if name == "compile" and dev.type != "cuda" and not named:
        return f"takes CUDA calls only (CPU calls take it when {dispatch.ENV_BACKEND}=compile)"
    return ""


def _short(why: str) -> str:
    """The first clause of an ``unavailable`` reason (the op table repeats it per op)."""
    return why.split(";", 1)[0].split(" (", 1)[0]


def _samples(ops):
    """op -> a sample Case (first case of its family table) or the reason there is none."""
    from lycoris_ops import testing
    from lycoris_ops._library.optable import BY_NAME

    family = {op: BY_NAME[op].family for op in ops}
    out, errors = {}, {}
    for fam in testing.FAMILIES:
        try:
            for c in testing.cases(fam):
                out.setdefault(c.op, c)
        except Exception as exc:
            errors[fam] = f"case table {fam}: {type(exc).__name__}: {exc}"[:90]
    for op in ops:
        out.setdefault(op, errors.get(family[op], "no sample case"))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lycoris_ops", description=__doc__.splitlines()[0])
    ap.add_argument("--no-samples", action="store_true", help="skip the per-op table")
    ap.add_argument("--why", action="store_true", help="show why each skipped tier was skipped")
    opts = ap.parse_args(argv)

    import torch

    import lycoris_ops
    from lycoris_ops.backends import registry as dispatch, select
    from lycoris_ops import settings
    from lycoris_ops.tuner import tune

    print(f"lycoris_ops {lycoris_ops.__version__}  ({os.path.dirname(lycoris_ops.__file__)})")
    cuda = getattr(torch.version, "cuda", None)
    print(f"  torch {torch.__version__} (CUDA {cuda or 'none'}), triton {_version('triton')}, "
          f"tilelang {_version('tilelang')}, python {sys.version.split()[0]}")

    devices = _devices(torch)
    print("\ndevices:")
    for d in devices:
        print(f"  {_describe(torch, d)}")

    print("\nbackends:")
    try:
        setting = dispatch.backend_setting()
    except ValueError as exc:
        print(f"  ERROR: {exc}")
        return 2
    print(f"  setting: {setting}    order: {' > '.join(dispatch.ORDER)}    fused: {', '.join(dispatch.FUSED)}")
    print(f"  available: {', '.join(dispatch.available_backends()) or 'none'}")
    for name in dispatch.ORDER:
        err = dispatch.probe_error(name)
        if err:
            print(f"  absent: {name} ({err})")
    for name in dispatch.FUSED:
        module = dispatch.opset(name)
        if module is None:
            if dispatch.probe_error(name) is None:
                print(f"  {name}: no op set ({dispatch.opset_error(name)})")
            continue
        have = [op for op in lycoris_ops.OP_NAMES if getattr(module, op, None) is not None]
        print(f"  {name} op set: {len(have)}/{len(lycoris_ops.OP_NAMES)} ops, devices "
              f"{', '.join(dispatch.device_types(module))}")
    absent = {}  # device -> {tier: why it takes no calls there}
    for d in devices:
        print(f"  {str(d):8s} available: {', '.join(dispatch.available_backends(d))};  "
              f"fused: {', '.join(dispatch.fused_backends(d)) or 'none'};  resolves to {dispatch.resolve_backend(d)}")
        absent[d] = {n: why for n in dispatch.ORDER if (why := unavailable(torch, dispatch, n, d))}
        if opts.why:
            for n, why in absent[d].items():
                print(f"    {n}: {why}")
    for (name, dev), err in dispatch.demotions().items():
        print(f"  demoted: {name} on {dev}: {err}")

    print("\nenvironment:")
    for var, setting in settings.SETTINGS.items():  # every value was checked by `import lycoris_ops`
        text = settings.raw(var)
        print(f"  {var} (unset: {setting.shown_default})" if text is None else f"  {var}={text!r}")
    for var in ("TORCHDYNAMO_DISABLE", "TRITON_INTERPRET", "TILELANG_CACHE_DIR"):
        print(f"  {var}={os.environ[var]!r}" if var in os.environ else f"  {var} (unset)")
    print(f"  tuning: {'on' if dispatch.tuning_enabled() else 'off'}")
    path = tune.table_path()
    print(f"  tuning table: {path} ({'exists' if os.path.exists(path) else 'not written yet'})")

    if opts.no_samples:
        return 0
    print("\nops (backend a sample call would take; nothing is run):")
    samples = _samples(lycoris_ops.OP_NAMES)
    width = max(len(op) for op in lycoris_ops.OP_NAMES)
    head = "  " + "op".ljust(width) + "  " + "  ".join(str(d).ljust(10) for d in devices) + "  op sets"
    print(head)
    for op in lycoris_ops.OP_NAMES:
        sets = ",".join(n for n in dispatch.FUSED if getattr(dispatch.opset(n), op, None) is not None) or "-"
        case = samples.get(op)
        cells, notes = [], []
        for d in devices:
            if isinstance(case, str):
                cells.append("-")
                continue
            try:
                c = case.to(device=d)
                steps = select.trace(op, *c.args)
                cells.append(steps[-1][0])
                if opts.why:
                    skipped = dict(steps[:-1])
                    tiers = [t for t in steps[:-1] if t[0] not in dispatch.ORDER]  # "*": the whole call
                    for tier in dispatch.ORDER[:dispatch.ORDER.index(steps[-1][0])] \
                            if steps[-1][0] in dispatch.ORDER else ():
                        why = skipped.get(tier) or _short(absent[d].get(tier, ""))
                        if why:
                            tiers.append((tier, why))
                    if tiers:
                        notes.append(f"{d}: skipped " + ", ".join(f"{t} ({why})" for t, why in tiers))
            except Exception as exc:
                cells.append("error")
                notes.append(f"{d}: {type(exc).__name__}: {str(exc)[:100]}")
        if isinstance(case, str):
            notes.append(case)
        print("  " + op.ljust(width) + "  " + "  ".join(x.ljust(10) for x in cells) + f"  {sets}")
        for n in notes:
            print("  " + " " * width + "    " + n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
