"""Record every Triton kernel launch made through the interpreter, so that CI can compile each one for sm_90.

Triton's interpreter runs kernels that the compiler refuses (a variable that changes type in a branch,
a ``tl.arange`` that is not a power of two), so every launch the CPU tests and notebooks make is also
compiled ahead of time by ``test_aot_compile.py``, under each supported Triton. With
``SPARSE_REF_RECORD_LAUNCHES=<file>`` set, ``install()`` (called by ``conftest.py`` and, in notebook
kernels, by the IPython start-up file that ``conftest.py`` writes) wraps the interpreter's launch and
appends one JSON line per distinct launch: the kernel, where its code lives, every argument's Triton
type (``*fp32``, ``i32``, ...) and every constexpr, as the compiler would specialise them (an int
argument equal to 1 arrives as the constant 1, ``None`` as a constexpr).

A kernel defined in an importable module is found again by module and name; one defined in a notebook
(module ``__main__``) is recorded with the sources of the ``@triton.jit`` functions of its namespace.
"""

from __future__ import annotations

import inspect
import json
import os

import torch

ENV = "SPARSE_REF_RECORD_LAUNCHES"
_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
           torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
           torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}
_OPTIONS = ("num_warps", "num_stages", "num_ctas")
_seen: set[str] = set()


def _arg_type(value):
    """The Triton type of a runtime argument, or ``("constexpr", value)`` where the compiler specialises it (an
    int equal to 1, ``None``); a tuple gives a list of those, element by element."""
    if value is None:
        return ("constexpr", None)
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[value.dtype]
    if isinstance(value, bool):
        return "u1"
    if isinstance(value, int):
        if value == 1:
            return ("constexpr", 1)
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    if isinstance(value, tuple):
        return [_arg_type(v) for v in value]
    raise TypeError(f"no Triton type for {type(value).__name__}")


def _jit_sources(fn) -> list[str]:
    """The sources of every ``@triton.jit`` function in the notebook namespace of ``fn`` (kernel first)."""
    kernel_type = _kernel_type()
    sources = [inspect.getsource(fn)]
    for value in fn.__globals__.values():
        if isinstance(value, kernel_type) and value.fn is not fn and value.fn.__module__ == "__main__":
            sources.append(inspect.getsource(value.fn))
    return sources


def _imports(fn) -> list[list[str]]:
    """``[module, name, alias]`` of the jit functions the notebook imported from modules (the package's helpers;
    ``alias``: the name the notebook gave it, ``from module import name as alias``)."""
    kernel_type = _kernel_type()
    return sorted([value.fn.__module__, value.fn.__name__, name] for name, value in fn.__globals__.items()
                  if isinstance(value, kernel_type) and value.fn.__module__ != "__main__")


def record(kernel, args, kwargs) -> dict | None:
    """The record of one launch (``None`` if an argument has no Triton type); appended to the file once."""
    fn = kernel.fn
    params = list(inspect.signature(fn).parameters.values())
    bound = dict(zip([p.name for p in params], args, strict=False))
    bound.update({k: v for k, v in kwargs.items() if k in {p.name for p in params}})
    signature, constexprs = {}, {}  # constexprs: by name, or "i,j" for element j of tuple argument i
    for i, p in enumerate(params):
        value = bound.get(p.name, p.default)
        if "constexpr" in str(p.annotation):
            constexprs[p.name] = value
            continue
        try:
            kind = _arg_type(value)
        except TypeError:
            return None
        if isinstance(kind, tuple):
            constexprs[p.name] = kind[1]
        elif isinstance(kind, list):
            for j, elem in enumerate(kind):
                if isinstance(elem, tuple):
                    constexprs[f"{i},{j}"] = elem[1]
            signature[p.name] = ["constexpr" if isinstance(e, tuple) else e for e in kind]
        else:
            signature[p.name] = kind
    entry = {"kernel": fn.__name__, "module": fn.__module__, "signature": signature, "constexprs": constexprs,
             "options": {k: kwargs[k] for k in _OPTIONS if k in kwargs}}
    if fn.__module__ == "__main__":
        entry["sources"], entry["imports"] = _jit_sources(fn), _imports(fn)
    key = json.dumps(entry, sort_keys=True, default=str)
    if key not in _seen:
        _seen.add(key)
        with open(os.environ[ENV], "a") as f:
            f.write(key + "\n")
    return entry


def _kernel_type():
    import triton

    @triton.jit
    def _probe():
        pass

    return type(_probe)


def install() -> bool:
    """Wrap the interpreter's launch so every launch is recorded (when ``SPARSE_REF_RECORD_LAUNCHES`` is set)."""
    if not os.environ.get(ENV) or os.environ.get("TRITON_INTERPRET", "").lower() not in ("1", "true", "on", "yes"):
        return False
    kernel_type = _kernel_type()
    if getattr(kernel_type.run, "_records_launches", False):
        return True
    run = kernel_type.run

    def recorded_run(self, *args, grid, warmup, **kwargs):
        if not warmup:
            record(self, args, kwargs)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    recorded_run._records_launches = True
    kernel_type.run = recorded_run
    return True
